"""Distributed user-model training throughput: 1 vs 2 processes, bf16 vs FP8, side by side.

    .venv/bin/python bench/train.py [--d-model 256] [--steps 24] [--tokens-per-step 4096] [--users 400]

Every configuration runs the real launcher (torchrun ranks, torchrec DMP embeddings, DeepSpeed ZeRO-2 engine)
on the same learnable training set for the same steps, then reads the run's ``perf.json`` (throughput and MFU
after warm-up steps) and ``metrics.json`` (validation NE). Printed:
- tokens/s and MFU (model FLOPs / step time / this machine's bf16 GEMM peak, measured once here);
- scaling efficiency = tokens/s(2 ranks x 1 core) / (2 x tokens/s(1 rank x 1 core)), the per-core efficiency
  of splitting the work (same total cores per rank);
- FP8 vs bf16 at 2 ranks: throughput ratio and NE.
Goals on this 2-core CPU: MFU >= 30% of the bf16 peak at d_model >= 256; scaling efficiency >= 0.8.
Figures on a shared machine move with its load: run it when the cores are quiet.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemflow.config import load_config  # noqa: E402
from gemflow.workspace import Workspace  # noqa: E402
from models.config import TrainRunConfig  # noqa: E402
from models.distributed.launch import launch  # noqa: E402
from models.distributed.mfu import measure_matmul_peak  # noqa: E402
from tests.models.distributed.conftest import write_learnable_set  # noqa: E402

CONFIGS = {  # name -> (nproc, threads per rank, overrides)
    "1 rank x 1 core, bf16": (1, 1, {}),
    "1 rank x 2 cores, bf16": (1, 2, {}),
    "2 ranks x 1 core, bf16": (2, 1, {}),
    "2 ranks x 1 core, FP8": (2, 1, {"distributed.fp8.recipe": "tensorwise"}),
}


def run_config(
    ws: Workspace, name: str, nproc: int, threads: int, overrides: dict, args, peak: float
) -> dict:
    out = ws.root / "runs" / name.replace(" ", "_").replace(",", "")
    cfg = load_config(
        TrainRunConfig,
        None,
        {
            "training_set": "distributed-bench",
            "output_dir": str(out),
            "resume": "false",
            "tracking.enabled": "false",
            "user_model.d_model": str(args.d_model),
            "user_model.num_heads": "4",
            "user_model.max_history": "256",
            "optim.log_every": "1000",
            "optim.epochs": "100",
            "distributed.max_steps": str(args.steps),
            "distributed.checkpoint.every_steps": "0",
            "distributed.tokens_per_step": str(args.tokens_per_step),
            "distributed.nproc": str(nproc),
            "distributed.threads_per_rank": str(threads),
            "distributed.peak_tflops": str(peak),
            **overrides,
        },
    )
    run_dir = launch(cfg, ws)
    perf = json.loads((run_dir / "perf.json").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {**perf, "valid_ne": metrics["valid_ne"], "initial_valid_ne": metrics.get("initial_valid_ne")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--tokens-per-step", type=int, default=4096)
    parser.add_argument("--users", type=int, default=400)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="0 = measure the bf16 GEMM peak here")
    parser.add_argument("--only", nargs="*", default=None, help="subset of the configuration names")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="gemflow-bench-train-"))
    ws = Workspace(root)
    if not ws.training("distributed-bench").exists():
        write_learnable_set(ws.training("distributed-bench"), num_users=args.users)
    peak = args.peak_tflops or measure_matmul_peak(torch.bfloat16, size=1024, seconds=3.0) / 1e12
    print(f"bf16 GEMM peak: {peak * 1e3:.1f} GFLOP/s; d_model={args.d_model}, {args.steps} steps of "
          f"{args.tokens_per_step} tokens; workspace {root}", flush=True)  # fmt: skip

    results = {}
    for name, (nproc, threads, overrides) in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        results[name] = run_config(ws, name, nproc, threads, overrides, args, peak)
        r = results[name]
        print(f"  done: {name}: {r['tokens_per_second']:.0f} tokens/s, MFU {r['mfu']:.1%}", flush=True)

    print(
        f"\n{'configuration':<26} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'step s':>7} {'imbal':>6} {'valid NE':>9}"
    )
    for name, r in results.items():
        print(f"{name:<26} {r['tokens_per_second']:>9.0f} {r['model_tflops_per_second']:>8.4f} {r['mfu']:>6.1%} "
              f"{r['step_seconds_median']:>7.3f} {r['token_imbalance_mean']:>6.3f} {r['valid_ne']:>9.4f}")  # fmt: skip
    one, two = results.get("1 rank x 1 core, bf16"), results.get("2 ranks x 1 core, bf16")
    if one and two:
        eff = two["tokens_per_second"] / (2 * one["tokens_per_second"])
        print(f"\nscaling efficiency (2 ranks vs 2 x 1 rank, 1 core each): {eff:.2f}  (goal >= 0.8)")
    fp8 = results.get("2 ranks x 1 core, FP8")
    if two and fp8:
        print(f"FP8 / bf16 throughput at 2 ranks: {fp8['tokens_per_second'] / two['tokens_per_second']:.2f}x; "
              f"valid NE bf16 {two['valid_ne']:.4f} vs FP8 {fp8['valid_ne']:.4f} "
              f"({(fp8['valid_ne'] / two['valid_ne'] - 1):+.2%})")  # fmt: skip
    best = max((r["mfu"] for r in results.values()), default=float("nan"))
    print(f"best MFU: {best:.1%} of the bf16 peak (goal >= 30% at d_model >= 256)")


if __name__ == "__main__":
    main()
