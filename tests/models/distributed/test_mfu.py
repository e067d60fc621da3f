"""The analytic FLOP count of a user-model step agrees with torch's FlopCounterMode on a real step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gemflow.workspace import Workspace
from models.training.distributed.mfu import counted_flops, measure_matmul_peak, mfu, user_model_flops
from models.training.prepare import prepare
from models.training.train import loss_fn
from tests.models.distributed.conftest import small_config


@pytest.mark.parametrize("next_event_weight", [0.0, 0.1])
def test_analytic_flops_match_flop_counter(training_set, tmp_path, next_event_weight):
    cfg = small_config(training_set, **{"user_model.next_event_weight": next_event_weight})
    setup = prepare(cfg, Workspace(tmp_path / "ws"))
    model = setup.bundle.model.train()
    # equal history lengths: one attention bucket without padding, so counted == useful work
    cuts = setup.data.examples["cut"].to_numpy()
    rows = setup.train_rows[cuts[setup.train_rows] >= 16][:24]
    builder = setup.builder
    builder.history_len = 16
    batch = builder(rows)
    assert set(batch.history.lengths.tolist()) == {16}

    def step():
        logits, aux = model(batch)
        loss_fn(logits, batch.labels, aux, cfg).backward()

    counted = counted_flops(step)
    analytic = user_model_flops(
        cfg.user_model, batch.history.lengths.tolist(), num_dense=len(setup.bundle.dense.columns)
    )
    assert analytic == pytest.approx(counted, rel=0.03), (analytic, counted)


def test_forward_only_is_a_third_and_moe_counts_top_k_experts(training_set):
    cfg = small_config(training_set, **{"user_model.next_event_weight": 0.0}).user_model
    lens = [10, 40, 3]
    train = user_model_flops(cfg, lens, num_dense=5)
    assert user_model_flops(cfg, lens, num_dense=5, training=False) * 3 == pytest.approx(train, rel=0.02)
    cfg.ffn = ["moe", "moe"]
    top1 = user_model_flops(cfg, lens, num_dense=5, moe_top_k=1, training=False)
    top2 = user_model_flops(cfg, lens, num_dense=5, moe_top_k=2, training=False)
    ffn_per_layer = 4 * cfg.ffn_mult * sum(lens) * cfg.d_model**2
    assert top2 - top1 == pytest.approx(2 * ffn_per_layer)


def test_matmul_peak_and_mfu():
    peak = measure_matmul_peak(torch.float32, size=256, seconds=0.2)
    assert peak > 1e8  # any CPU does > 0.1 GFLOP/s
    assert mfu(2e9, 1.0, 4e9) == 0.5
    assert np.isnan(mfu(1.0, 0.0, 1.0))


def test_cpu_time_peak_is_at_least_the_wall_peak_on_one_thread():
    """Per CPU-second a core cannot be slower than per wall second (waiting for the core costs no CPU time)."""
    wall = measure_matmul_peak(torch.float32, size=256, seconds=0.3, threads=1)
    cpu = measure_matmul_peak(torch.float32, size=256, seconds=0.3, threads=1, cpu_time=True)
    assert cpu > 1e8 and cpu >= 0.7 * wall  # 0.7: the two runs are separate measurements
