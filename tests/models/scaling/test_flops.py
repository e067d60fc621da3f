"""FLOP counting: exact on a Linear, and on the user model it grows with width and history as it should."""

from __future__ import annotations

import numpy as np
import torch

from models.config import TrainRunConfig
from models.scaling.flops import sample_rows, step_flops, training_flops_per_example
from models.training.prepare import prepare
from tests.models.fixtures import tiny_set_path


def test_linear_forward_and_backward_match_the_analytic_count():
    batch, fan_in, fan_out = 8, 16, 4
    layer = torch.nn.Linear(fan_in, fan_out)
    x = torch.randn(batch, fan_in, requires_grad=True)
    # forward: 2*B*in*out; backward: grad of the input and of the weight, 2*B*in*out each
    assert step_flops(lambda: layer(x).sum()) == 6 * batch * fan_in * fan_out
    x_const = torch.randn(batch, fan_in)  # no input gradient -> only the weight's
    assert step_flops(lambda: layer(x_const).sum()) == 4 * batch * fan_in * fan_out


def _per_example(workspace, **user_model) -> float:
    cfg = TrainRunConfig(training_set=str(tiny_set_path()))
    cfg.tracking.enabled = False
    cfg.user_model.num_heads = 2
    cfg.user_model.num_user_tokens = 2
    for k, v in user_model.items():
        setattr(cfg.user_model, k, v)
    return training_flops_per_example(prepare(cfg, workspace), cfg, 64)


def test_user_model_flops_grow_with_width_and_history(workspace):
    base = _per_example(workspace, d_model=16, num_layers=1, max_history=8)
    wider = _per_example(workspace, d_model=32, num_layers=1, max_history=8)
    deeper = _per_example(workspace, d_model=16, num_layers=2, max_history=8)
    longer = _per_example(workspace, d_model=16, num_layers=1, max_history=32)
    assert base > 0
    assert 2.5 < wider / base < 4.5  # mostly d^2 (projections), partly d (attention, heads)
    assert deeper > base and longer > base


def test_counting_leaves_the_weights_untouched(workspace):
    cfg = TrainRunConfig(training_set=str(tiny_set_path()))
    cfg.tracking.enabled = False
    cfg.user_model.num_heads, cfg.user_model.d_model, cfg.user_model.num_user_tokens = 2, 16, 2
    setup = prepare(cfg, workspace)
    before = {k: v.clone() for k, v in setup.bundle.model.state_dict().items()}
    training_flops_per_example(setup, cfg, 32)
    for k, v in setup.bundle.model.state_dict().items():
        assert torch.equal(before[k], v), k
    assert all(p.grad is None for p in setup.bundle.model.parameters())


def test_sample_rows_is_fixed_and_sorted():
    rows = np.arange(1000)
    a, b = sample_rows(rows, 10, 0), sample_rows(rows, 10, 0)
    assert np.array_equal(a, b) and np.all(np.diff(a) > 0)
    assert len(sample_rows(rows[:5], 10)) == 5
