"""perf.json of a run: wall and CPU-clock throughput, the slowest rank's CPU time as the critical path."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from models.training.distributed.profiling import PERF_WARMUP_STEPS, StepProfiler, write_perf


def test_perf_reports_the_slowest_rank_per_step_after_warm_up(tmp_path):
    p = SimpleNamespace(
        world=2,
        cfg=SimpleNamespace(
            distributed=SimpleNamespace(peak_tflops=0.5, compile="off", precision="fp32", zero_stage="0")
        ),
        fp8_modules=[],
        fp8_gemm="",
        tower=nn.Linear(2, 2),
    )
    steps = PERF_WARMUP_STEPS + 2
    stats = [{"seconds": 2.0, "flops": 1e12, "tokens": [60, 40], "imbalance": 1.2} for _ in range(steps)]
    warm = [9.0] * PERF_WARMUP_STEPS  # slow first steps are left out
    cpu_by_rank = [warm + [1.0, 3.0], warm + [2.0, 1.0]]
    write_perf(p, tmp_path, stats, cpu_by_rank)
    perf = json.loads((tmp_path / "perf.json").read_text())
    assert perf["steps_timed"] == 2 and perf["precision"] == "fp32" and perf["zero_stage"] == 0
    assert perf["tokens_per_second"] == pytest.approx(200 / 4.0)
    assert perf["mfu"] == pytest.approx(2e12 / 4.0 / 0.5e12)
    assert perf["critical_cpu_seconds"] == pytest.approx(2.0 + 3.0)  # rank 1 is slower at step 1, rank 0 at 2
    assert perf["cpu_core_seconds"] == pytest.approx(7.0)
    assert perf["tokens_per_critical_cpu_second"] == pytest.approx(200 / 5.0)
    assert perf["model_tflops_per_cpu_core_second"] == pytest.approx(2.0 / 7.0)
    assert perf["rank_cpu_imbalance_mean"] == pytest.approx((2.0 / 1.5 + 3.0 / 2.0) / 2)


def test_profiled_steps_leave_the_throughput_and_every_ranks_account_is_kept(tmp_path):
    p = SimpleNamespace(
        world=2,
        cfg=SimpleNamespace(
            distributed=SimpleNamespace(peak_tflops=0.5, compile="on", precision="bf16", zero_stage="2")
        ),
        fp8_modules=[],
        fp8_gemm="",
        tower=nn.Linear(2, 2),
    )
    steps = PERF_WARMUP_STEPS + 3
    stats = [{"seconds": 2.0, "flops": 1e12, "tokens": [60, 40], "imbalance": 1.0} for _ in range(steps)]
    stats[0]["seconds"] = 30.0  # the first step compiles
    stats[PERF_WARMUP_STEPS + 1] |= {"seconds": 8.0, "profiled": True}  # profiler overhead: not timed
    cpu_by_rank = [[1.0] * steps, [1.0] * steps]
    cpu_by_rank[0][PERF_WARMUP_STEPS + 1] = 50.0
    accounts = [{"non_gemm_share": 0.6}, {"non_gemm_share": 0.5}]
    write_perf(p, tmp_path, stats, cpu_by_rank, accounts)
    perf = json.loads((tmp_path / "perf.json").read_text())
    assert perf["steps_timed"] == 2
    assert perf["tokens_per_second"] == pytest.approx(200 / 4.0)
    assert perf["critical_cpu_seconds"] == pytest.approx(2.0)
    assert perf["step_account"] == accounts
    assert perf["first_step_seconds"] == 30.0 and perf["compile"] == "on"


def test_the_step_account_profiles_four_steps_from_the_configured_one():
    """``distributed.step_account_from``: a window past the warm-up (steps 6-9 here), every step in it booked."""
    profiler = StepProfiler(None, rank=0, step_account=True, first_step=6)
    profiled = []
    for i in range(12):
        profiler.at_step(i)
        profiled.append(profiler.prof is not None)
        torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    profiler.stop()
    assert profiled == [False] * 6 + [True] * 4 + [False] * 2
    assert profiler.account["profiled_steps"] == 4 and profiler.account["seconds_per_step"]["gemm"] > 0
