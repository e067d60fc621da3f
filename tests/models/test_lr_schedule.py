"""The dense-lr schedule of models/training/train.py: off by default, warm-up then cosine/linear decay."""

import math

import pytest

from models.config import OptimConfig, TrainRunConfig, validate
from models.training.optimizers import scheduled_lr


def test_default_schedule_is_the_constant_lr():
    oc = OptimConfig()
    assert [scheduled_lr(0.01, step, 100, oc) for step in (0, 50, 99, 500)] == [0.01] * 4


def test_warmup_rises_linearly_then_cosine_decays_to_the_floor():
    oc = OptimConfig(warmup_steps=10, lr_decay="cosine", min_lr_ratio=0.1)
    lrs = [scheduled_lr(1.0, step, 110, oc) for step in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10], strict=False))  # rising warm-up
    assert lrs[10] == pytest.approx(1.0)  # decay starts at the peak
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway: 0.55
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))  # never rises again
    assert scheduled_lr(1.0, 110, 110, oc) == pytest.approx(0.1)  # the floor at the last step, and after
    assert scheduled_lr(1.0, 500, 110, oc) == pytest.approx(0.1)


def test_linear_decay_without_warmup():
    oc = OptimConfig(lr_decay="linear")
    assert [scheduled_lr(2.0, s, 4, oc) for s in range(5)] == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])


def test_unknown_decay_is_rejected_by_name():
    cfg = TrainRunConfig()
    cfg.optim.lr_decay = "step"
    with pytest.raises(ValueError, match="optim.lr_decay"):
        validate(cfg)
