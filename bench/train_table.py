"""The distributed-training acceptance table: validation NE of each feature alone and all together.

    nice -n 10 .venv/bin/python bench/train_table.py [--users 300] [--workdir DIR] [--only NAME ...]

Every row is a real ``gemflow train --model user --nproc N`` launch (torchrun ranks, torchrec DMP ad/user
embeddings, replicated vocabulary tables, DeepSpeed engine) on the same learnable training set with the same step
budget (2 epochs of 2,000-token steps, lr 1e-3: the regime of ``tests/models/distributed/test_launch.py``), so the
NE differences measure the features, not the data. Baseline: 1 process, bf16, no ZeRO, dense FFNs. Printed per row: validation NE, its
change relative to the baseline (acceptance: the full 2-process ZeRO-2 + MoE(ep_size 2) + FP8 row within 1%),
test NE, wall and CPU seconds. About 10-15 CPU-minutes in all on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import add_record_flag, record  # noqa: E402

from gemflow.config import load_config  # noqa: E402
from gemflow.workspace import Workspace  # noqa: E402
from models.config import TrainRunConfig  # noqa: E402
from models.training.distributed.launch import launch  # noqa: E402
from tests.models.distributed.conftest import write_learnable_set  # noqa: E402

COMMON = {  # the acceptance test's regime
    "user_model.d_model": 64,
    "user_model.max_history": 64,
    "optim.epochs": 2,
    "optim.lr": 1e-3,
    "optim.log_every": 10,
    "distributed.tokens_per_step": 2000,
    "distributed.replicate_max_rows": 40,  # the ad and user tables sharded (as at scale), the vocabularies replicated
    "distributed.threads_per_rank": 1,
    "distributed.checkpoint.every_steps": 0,
    "distributed.peak_tflops": 0.1,  # MFU is not what this table is about
    "tracking.enabled": "false",
    "resume": "false",
}
MOE = {"user_model.ffn": "moe,moe", "distributed.moe.ep_size": 2, "distributed.moe.num_experts": 4}
FP8 = {"distributed.fp8.recipe": "tensorwise"}
ROWS = {  # name -> (nproc, overrides); the first row is the baseline
    "1 proc bf16 (baseline)": (1, {"distributed.zero_stage": 0}),
    "2 proc data parallel (ZeRO-0)": (2, {"distributed.zero_stage": 0}),
    "2 proc ZeRO-2 alone": (2, {"distributed.zero_stage": 2}),
    "2 proc MoE (ep 2) alone": (2, {"distributed.zero_stage": 0, **MOE}),
    "1 proc FP8 alone": (1, {"distributed.zero_stage": 0, **FP8}),
    "2 proc ZeRO-2 + MoE (ep 2) + FP8": (2, {"distributed.zero_stage": 2, **MOE, **FP8}),
}


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_row(ws: Workspace, name: str, nproc: int, overrides: dict) -> dict:
    out = ws.root / "runs" / name.split(" (")[0].replace(" ", "_").replace("+", "")
    values = {**COMMON, **overrides, "training_set": "learnable", "output_dir": str(out),
              "distributed.nproc": nproc}  # fmt: skip
    cfg = load_config(TrainRunConfig, None, {k: str(v) for k, v in values.items()})
    wall, cpu = time.perf_counter(), children_cpu_seconds()
    run_dir = launch(cfg, ws)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    perf = json.loads((run_dir / "perf.json").read_text())
    return {**metrics, "wall_s": time.perf_counter() - wall, "cpu_s": children_cpu_seconds() - cpu,
            "nproc": nproc, "fp8_linears": perf["fp8_linears"], "moe_layers": perf["moe_layers"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=300)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--only", nargs="*", default=None, help="subset of the row names (baseline always runs)"
    )
    add_record_flag(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="gemflow-train-table-"))
    ws = Workspace(root)
    if not ws.training("learnable").exists():
        write_learnable_set(ws.training("learnable"), num_users=args.users)
    print(f"workspace {root}; {args.users} users; every row: 2 epochs of 2,000-token steps", flush=True)

    results = {}
    for i, (name, (nproc, overrides)) in enumerate(ROWS.items()):
        if i and args.only and name not in args.only:
            continue
        results[name] = run_row(ws, name, nproc, overrides)
        r = results[name]
        print(f"  done: {name}: valid NE {r['valid_ne']:.4f} ({r['wall_s']:.0f} s)", flush=True)

    base = next(iter(results.values()))["valid_ne"]
    print(f"\n{'configuration':<34} {'steps':>5} {'valid NE':>9} {'vs base':>8} {'start NE':>9} {'test NE':>8} "
          f"{'wall s':>7} {'CPU s':>6}")  # fmt: skip
    for name, r in results.items():
        print(f"{name:<34} {r['steps']:>5.0f} {r['valid_ne']:>9.4f} {r['valid_ne'] / base - 1:>+8.2%} "
              f"{r['initial_valid_ne']:>9.4f} {r['test_ne']:>8.4f} {r['wall_s']:>7.0f} {r['cpu_s']:>6.0f}")  # fmt: skip
    full = results.get("2 proc ZeRO-2 + MoE (ep 2) + FP8")
    if full:
        rel = abs(full["valid_ne"] / base - 1)
        verdict = "within" if rel < 0.01 else "NOT within"
        print(f"\nfull 2-process run vs 1-process bf16: {rel:.2%} relative ({verdict} the 1% goal)")
    print(f"total CPU: {sum(r['cpu_s'] for r in results.values()) / 60:.1f} core-min")
    if args.record:
        rows = [(f"{name}: valid NE (vs baseline), test NE", f"{r['valid_ne']:.4f} ({r['valid_ne'] / base - 1:+.2%}), {r['test_ne']:.4f}")
                for name, r in results.items()]  # fmt: skip
        record("train_table", "distributed-training features, validation NE (bench/train_table.py)", rows)


if __name__ == "__main__":
    main()
