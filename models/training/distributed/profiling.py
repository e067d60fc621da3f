"""Where a rank's step time goes, and the run's throughput: ``StepProfiler`` (torch.profiler over a window of
steps: op tables and a Chrome trace under ``GEMFLOW_PROFILE_DIR``, and/or the step account of
``distributed.step_account``) and ``write_perf`` (``perf.json``: wall and CPU-clock throughput and MFU)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from models.inference.compile import compile_seconds
from models.training.distributed.engine import Parts
from models.training.distributed.fp8_gemm import figures
from models.training.distributed.mfu import mfu
from models.training.distributed.moe import moe_layers
from models.training.distributed.step_account import account

log = logging.getLogger("gemflow.distributed")


# Profiling: torch.profiler over steps [distributed.step_account_from, +PROFILE_STEPS) -> <dir>/rank-<r>.txt (op
# table) and a Chrome trace; where a step's time goes (embedding all-to-all, dense fwd/bwd, ZeRO reduce, optimizer)
PROFILE_DIR = "GEMFLOW_PROFILE_DIR"
PROFILE_STEPS = 4


class StepProfiler:
    """torch.profiler over a window of steps when ``GEMFLOW_PROFILE_DIR`` is set and/or ``step_account`` (the
    step account, kept in ``self.account``); neither: does nothing."""

    def __init__(self, folder: str | None, rank: int, step_account: bool = False, first_step: int = 4):
        self.folder, self.rank, self.prof = Path(folder) if folder else None, rank, None
        self.step_account, self.account, self.steps = step_account, {}, 0
        self.first_step = first_step

    def at_step(self, i: int) -> None:
        if self.folder is None and not self.step_account:
            return
        if i == self.first_step:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=self.folder is not None)
            self.prof.__enter__()
        elif i == self.first_step + PROFILE_STEPS:
            self.stop()
        if self.prof is not None:
            self.steps += 1  # steps started inside the window

    def stop(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        if self.step_account:
            self.account = account(self.prof.events(), max(self.steps, 1))
        if self.folder is None:
            self.prof = None
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        table = self.prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=100, max_name_column_width=70
        )
        (self.folder / f"rank-{self.rank}.txt").write_text(table)
        by_shape = self.prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60, max_shapes_column_width=120
        )
        (self.folder / f"rank-{self.rank}-shapes.txt").write_text(by_shape)
        self.prof.export_chrome_trace(str(self.folder / f"rank-{self.rank}.json"))
        self.prof = None


PERF_WARMUP_STEPS = 3  # the first steps pay for lazy initialisation and allocator warm-up


def write_perf(
    p: Parts,
    run_dir: Path,
    stats: list[dict],
    cpu_by_rank: list[list[float]],
    accounts: list[dict] | None = None,
) -> None:
    """Throughput and MFU of this launch's steps after warm-up (what bench/train.py reads).

    Wall-clock figures, and the same in CPU time for a machine shared with other work (where wall time
    measures the neighbours): ``cpu_core_seconds`` is the CPU time of all ranks (model FLOPs per core-second
    against a 1-core peak give the MFU the cores reach while they run this job); ``critical_cpu_seconds`` sums,
    step by step, the CPU time of the slowest rank, the wall time the run would take on idle cores (minus
    communication latency), so tokens over it give the quiet-machine throughput.
    """
    first = PERF_WARMUP_STEPS if len(stats) > PERF_WARMUP_STEPS else 0
    # steps under the profiler (distributed.step_account) pay its overhead: left out of the figures
    kept = [i for i in range(first, len(stats)) if not stats[i].get("profiled")]
    timed = [stats[i] for i in kept]
    if not timed:
        return
    seconds = sum(r["seconds"] for r in timed)
    flops = sum(r["flops"] for r in timed)
    tokens = float(np.sum([r["tokens"] for r in timed]))
    cpu = np.array([[c[i] for i in kept] for c in cpu_by_rank])  # (ranks, steps)
    critical, core_seconds = float(cpu.max(0).sum()), float(cpu.sum())
    peak = p.cfg.distributed.peak_tflops * 1e12
    perf = {
        "nproc": p.world,
        "threads_per_rank": torch.get_num_threads(),
        "steps_timed": len(timed),
        "step_seconds_median": float(np.median([r["seconds"] for r in timed])),
        "tokens_per_second": tokens / seconds,
        "model_tflops_per_second": flops / seconds / 1e12,
        "peak_tflops": p.cfg.distributed.peak_tflops,
        "mfu": mfu(flops, seconds, peak),
        "token_imbalance_mean": float(np.mean([r["imbalance"] for r in timed])),
        "cpu_core_seconds": core_seconds,
        "critical_cpu_seconds": critical,
        "tokens_per_critical_cpu_second": tokens / critical if critical > 0 else float("nan"),
        "model_tflops_per_cpu_core_second": flops / core_seconds / 1e12 if core_seconds > 0 else float("nan"),
        "rank_cpu_imbalance_mean": float(np.mean(cpu.max(0) / cpu.mean(0))),
        # per timed step: the slowest rank's CPU seconds, and the wall seconds (the minimum is the figure least
        # disturbed by other work on a shared machine)
        "critical_cpu_seconds_per_step": [float(c) for c in cpu.max(0)],
        "step_seconds": [float(r["seconds"]) for r in timed],
        "precision": p.cfg.distributed.precision,  # the dense tower's, as distributed.precision=auto chose
        "zero_stage": int(p.cfg.distributed.zero_stage),  # as distributed.zero_stage=auto chose
        "fp8_linears": len(p.fp8_modules),
        "fp8_gemm": p.fp8_gemm,  # which float8 GEMM ran, and the probe's GFLOP/s when rank 0 measured it
        "fp8_gemm_gflops": figures() if p.fp8_gemm else None,
        "moe_layers": len(moe_layers(p.tower)),
        "compile": p.cfg.distributed.compile,
        # the first step (compiles when compile is on; the step-0 evaluation compiles the inference graphs),
        # and the compiler's own seconds (dynamo + inductor, this rank)
        "first_step_seconds": float(stats[0]["seconds"]),
        "compile_seconds": compile_seconds(),
        "step_account": accounts or [],  # per rank: models.training.distributed.step_account.account
        # rank 0's mean seconds per step in each phase (wall includes waiting for the other ranks)
        "phase_seconds_mean": {
            k: float(np.mean([r.get(k, 0.0) for r in timed]))
            for k in timed[0]
            if k.startswith(("wall_", "cpu_"))
        },
    }
    (run_dir / "perf.json").write_text(json.dumps(perf, indent=2))
