"""Distributed user-model training throughput: 1 vs 2 processes, ZeRO stages, FP8, compiled, side by side.

    nice -n 10 .venv/bin/python bench/train.py [--d-model 256] [--steps 24] [--tokens-per-step 8192] [--precision auto]

Every configuration runs the real launcher (torchrun ranks, torchrec DMP embeddings for the ad and user tables,
the small vocabulary tables replicated on every rank, a DeepSpeed engine in the ZeRO stage the run chose: auto
takes plain data parallel for these small towers, the "ZeRO-2" configuration forces partitioned optimizer state)
on the same learnable training set for the same steps, then reads the run's ``perf.json`` (throughput after
warm-up steps) and ``metrics.json`` (validation NE). Every configuration runs the dense tower in one precision,
``--precision`` (default ``auto``: what ``distributed.precision=auto`` chooses on this machine, bf16 where it
multiplies at least as fast as fp32, printed with both rates; DeepSpeed's bf16 mode keeps the weights in bf16),
and MFU is against that precision's GEMM peak (both peaks are printed) of the cores the run uses (ranks x threads
per rank), measured here at 1 thread.

Two clocks, both printed:
- wall: tokens/s and MFU as a user sees them (only meaningful when the cores are otherwise idle);
- CPU: the same work over CPU time. MFU(cpu) = model FLOPs per core-second of the ranks / the 1-core GEMM peak
  per CPU-second; tokens/s(cpu) = tokens / the sum over steps of the slowest rank's CPU seconds (what the run
  takes on idle cores, minus communication latency). On a shared machine these are the figures that hold.
Scaling efficiency = tokens/s(2 ranks x 1 thread) / (2 x tokens/s(1 rank x 1 thread)), per clock, at the same
global token budget per step (strong scaling: each of 2 ranks gets half of ``--tokens-per-step``).
Per configuration it also prints where rank 0's step goes (sparse forward, dense forward, backward, optimizer
step; CPU | wall ms), from ``perf.json`` (``GEMFLOW_PROFILE_DIR=<dir>`` adds a torch.profiler table per rank).
FP8 vs the plain 2-rank run: throughput ratio and NE, and which float8 GEMM ran (on CPU the faster of torch._scaled_mm
and its bf16 emulation, measured at launch; ``--fp8-cpu-gemm scaled_mm|emulated`` forces one).
Step account (``distributed.step_account``, on unless ``--no-account``): every rank profiles 4 steps (from
``--account-from``, default 4; later, e.g. ``--steps 30 --account-from 20``, is past the warm-up) and
splits them into GEMM (the profiler's matmul kernels), attention, embedding lookups, optimizer, communication
and other (``models.training.distributed.step_account``); printed per rank with the share of the step outside GEMMs.
Those profiled steps are left out of the throughput figures.
Compiled configurations (``distributed.compile=on``: ``models.inference.compile``) run the same steps with the dense
tower's per-token work compiled by inductor; their first step (compile) is printed apart, and the NE of
compiled vs eager at the same seed (goal: within 0.2%). ``--only`` picks configurations by name.
Goals (issue 18): MFU >= 30% of the GEMM peak of the precision that ran, at d_model >= 256; scaling efficiency >= 0.85.
The wall-clock figures of record: ``OMP_NUM_THREADS=1 .venv/bin/python bench/train.py --steps 12`` on a quiet
machine (about 2-3 minutes: five launches of ~20-30 s each, the emulated-FP8 one ~40 s).
The current figures: docs/benchmarks.md (``--record`` writes them there); what they decided: docs/training-speed.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import add_record_flag, record  # noqa: E402

from gemflow.config import load_config  # noqa: E402
from gemflow.workspace import Workspace  # noqa: E402
from models.config import TrainRunConfig  # noqa: E402
from models.training.distributed.launch import launch  # noqa: E402
from models.training.distributed.mfu import measure_matmul_peak  # noqa: E402
from models.training.distributed.precision import dtype_of  # noqa: E402
from models.training.distributed.precision import resolve as resolve_precision  # noqa: E402
from models.training.distributed.step_account import CATEGORIES  # noqa: E402
from tests.models.distributed.conftest import write_learnable_set  # noqa: E402

PHASES = ("sparse_forward", "dense_forward", "backward", "optimizer_step")  # the trainer's step phases
CONFIGS = {  # name -> (nproc, threads per rank, overrides)
    "1 rank x 1 core": (1, 1, {}),
    "2 ranks x 1 core": (2, 1, {}),  # distributed.zero_stage=auto: 0 (plain data parallel) at these sizes
    "2 ranks x 1 core, ZeRO-2": (2, 1, {"distributed.zero_stage": "2"}),  # optimizer state partitioned
    "1 rank x 2 cores": (1, 2, {}),
    "2 ranks x 1 core, FP8": (2, 1, {"distributed.fp8.recipe": "tensorwise"}),
    "1 rank x 1 core, compiled": (1, 1, {"distributed.compile": "on"}),
    "2 ranks x 1 core, compiled": (2, 1, {"distributed.compile": "on"}),
}
RENAMED = {"2 ranks x 1 core, ZeRO-0": "2 ranks x 1 core"}  # auto chooses ZeRO-0 for the bench's towers
COMPILED_VS_EAGER = {"1 rank x 1 core, compiled": "1 rank x 1 core", "2 ranks x 1 core, compiled": "2 ranks x 1 core"}  # fmt: skip


def cpu_model() -> str:
    """The CPU's model name, family/model numbers and bf16 GEMM hardware (AMX tiles, AVX-512 BF16, neither)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    bf16 = (
        "AMX" if "amx_bf16" in flags else "AVX-512 BF16, no AMX" if "avx512_bf16" in flags else "no bf16 ISA"
    )
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}; {bf16})"


def run_config(
    ws: Workspace, name: str, nproc: int, threads: int, overrides: dict, args, core_peak: float
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
            "user_model.num_layers": str(args.layers),
            "user_model.max_history": "256",
            "optim.lr": str(args.lr),
            "optim.log_every": "1000",
            "optim.epochs": "100",
            "distributed.max_steps": str(args.steps),
            "distributed.checkpoint.every_steps": "0",
            "distributed.tokens_per_step": str(args.tokens_per_step),
            "distributed.replicate_max_rows": str(args.replicate_max_rows),
            "distributed.nproc": str(nproc),
            "distributed.threads_per_rank": str(threads),
            "distributed.peak_tflops": str(core_peak * nproc * threads),  # the cores this run uses
            "distributed.step_account": str(args.account).lower(),
            "distributed.step_account_from": str(args.account_from),
            "distributed.precision": args.precision,
            **overrides,
        },
    )
    run_dir = launch(cfg, ws)
    perf = json.loads((run_dir / "perf.json").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {**perf, "valid_ne": metrics["valid_ne"], "initial_valid_ne": metrics.get("initial_valid_ne")}


def fp8_gemm_line(perf: dict) -> str:
    """Which float8 GEMM a run used, with the launch-time probe's GFLOP/s when it was measured (not forced)."""
    g = perf.get("fp8_gemm_gflops")
    if not g:
        return f"{perf['fp8_gemm']} (forced)"
    return (f"{perf['fp8_gemm']} (probe, 1 rank: torch._scaled_mm {g['scaled_mm']:.2f} GFLOP/s = "
            f"{g['scaled_mm'] / g['bf16']:.3g}x bf16 {g['bf16']:.1f}; emulated {g['emulated']:.1f} = "
            f"{g['emulated'] / g['bf16']:.2f}x)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2, help="user-model layers (dense work per token)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument(
        "--lr",
        type=float,
        default=2.5e-4,
        help="dense lr (the scaling lab's width rule: 2e-3 x 32 / d_model; higher diverges at d=256)",
    )
    parser.add_argument("--tokens-per-step", type=int, default=8192)
    parser.add_argument("--users", type=int, default=400)
    parser.add_argument("--replicate-max-rows", type=int, default=40,
                        help="tables up to this many rows are replicated on every rank (the rest sharded); the "
                             "bench's catalog is tiny (81 ads, users + 1 rows): 40 keeps the ad and user tables "
                             "sharded, as at production scale, and replicates the vocabularies (actions, "
                             "surfaces, categories, advertisers, time gaps)")  # fmt: skip
    parser.add_argument(
        "--fp8-cpu-gemm",
        default="auto",
        choices=("auto", "scaled_mm", "emulated"),
        help="the FP8 configuration's float8 GEMM on CPU (distributed.fp8.cpu_gemm)",
    )
    parser.add_argument(
        "--no-account",
        dest="account",
        action="store_false",
        help="no step account (no profiled steps: all steps after warm-up are timed)",
    )
    parser.add_argument(
        "--account-from",
        type=int,
        default=4,
        help="the first of the 4 profiled steps (distributed.step_account_from); needs --steps >= it + 4",
    )
    parser.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "bf16", "fp32"),
        help="the dense tower's precision in every configuration (auto: distributed.precision=auto's choice)",
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=None, help="subset of the configuration names")
    add_record_flag(parser)
    args = parser.parse_args()
    if args.only:  # names before the precision became a choice ended in ", bf16"; ZeRO-0 is now the default's
        args.only = [RENAMED.get(n, n) for n in (name.removesuffix(", bf16") for name in args.only)]
        unknown = sorted(set(args.only) - set(CONFIGS))
        if unknown:
            parser.error(f"--only: unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    logging.basicConfig(level=logging.WARNING)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="gemflow-bench-train-"))
    ws = Workspace(root)
    if not ws.training("distributed-bench").exists():
        write_learnable_set(ws.training("distributed-bench"), num_users=args.users)
    peaks = {  # one core's GEMM peak: per wall second and per CPU second, bf16 and fp32
        (dtype, cpu): measure_matmul_peak(dtype, size=1024, seconds=2.0, threads=1, cpu_time=cpu) / 1e12
        for dtype in (torch.bfloat16, torch.float32)
        for cpu in (False, True)
    }
    args.precision, rates = resolve_precision(args.precision)
    dtype = dtype_of(args.precision)
    peak_wall, peak_cpu = peaks[(dtype, False)], peaks[(dtype, True)]
    print(f"CPU: {cpu_model()}")
    chosen = f"precision {args.precision}"
    if rates:
        chosen += f" (auto: one-thread linear bf16 {rates['bf16']:.1f} vs fp32 {rates['fp32']:.1f} GFLOP/s)"
    print(f"1-core GEMM peak, GFLOP/s per wall second | per CPU second: bf16 {peaks[(torch.bfloat16, False)] * 1e3:.1f} | "
          f"{peaks[(torch.bfloat16, True)] * 1e3:.1f}, fp32 {peaks[(torch.float32, False)] * 1e3:.1f} | "
          f"{peaks[(torch.float32, True)] * 1e3:.1f}; {chosen}\nd_model={args.d_model}, {args.layers} layers, {args.steps} steps of "
          f"{args.tokens_per_step} tokens; workspace {root}", flush=True)  # fmt: skip

    results = {}
    for name, (nproc, threads, overrides) in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        if "distributed.fp8.recipe" in overrides:
            overrides = {**overrides, "distributed.fp8.cpu_gemm": args.fp8_cpu_gemm}
        r = results[name] = run_config(ws, name, nproc, threads, overrides, args, peak_wall)
        r["mfu_cpu"] = r["model_tflops_per_cpu_core_second"] / peak_cpu
        if threads > 1:  # idle intra-op threads spin: their CPU time is no measure of work (wall only)
            r["mfu_cpu"] = r["tokens_per_critical_cpu_second"] = float("nan")
        print(f"  done: {name}: {r['tokens_per_second']:.0f} tokens/s (wall), "
              f"{r['tokens_per_critical_cpu_second']:.0f} (cpu); ZeRO stage {r.get('zero_stage', '?')}",
              flush=True)  # fmt: skip
        if r.get("fp8_gemm"):
            print(f"  float8 GEMM that ran: {fp8_gemm_line(r)}", flush=True)
        if r.get("compile", "off") != "off":
            print(f"  compile: first step {r['first_step_seconds']:.1f} s (median step {r['step_seconds_median']:.2f} s), "
                  f"compiler {r['compile_seconds']:.1f} s on rank 0 (dynamo + inductor, incl. the step-0 evaluation's graphs)",
                  flush=True)  # fmt: skip

    print(f"\n{'configuration':<26} {'tok/s wall':>10} {'MFU wall':>8} {'tok/s cpu':>9} {'MFU cpu':>7} "
          f"{'step s':>7} {'tok imbal':>9} {'cpu imbal':>9} {'valid NE':>9}")  # fmt: skip
    for name, r in results.items():
        print(f"{name:<26} {r['tokens_per_second']:>10.0f} {r['mfu']:>8.1%} {r['tokens_per_critical_cpu_second']:>9.0f} "
              f"{r['mfu_cpu']:>7.1%} {r['step_seconds_median']:>7.3f} {r['token_imbalance_mean']:>9.3f} "
              f"{r['rank_cpu_imbalance_mean']:>9.3f} {r['valid_ne']:>9.4f}")  # fmt: skip
    print("\nwhere a step goes, rank 0, CPU | wall ms per step (wall includes waiting for the other rank):")
    for name, r in results.items():
        ph = r.get("phase_seconds_mean", {})
        parts = [f"{k} {ph.get(f'cpu_{k}', 0) * 1e3:.0f}|{ph.get(f'wall_{k}', 0) * 1e3:.0f}" for k in PHASES]
        print(f"  {name:<26} " + ", ".join(parts))
    print_accounts(results, args.account_from)
    two = results.get("2 ranks x 1 core")
    for name, one_name in (("2 ranks x 1 core", "1 rank x 1 core"),
                           ("2 ranks x 1 core, ZeRO-2", "1 rank x 1 core"),
                           ("2 ranks x 1 core, compiled", "1 rank x 1 core, compiled")):  # fmt: skip
        one = results.get(one_name)
        if one and name in results:
            r = results[name]
            wall = r["tokens_per_second"] / (2 * one["tokens_per_second"])
            cpu = r["tokens_per_critical_cpu_second"] / (2 * one["tokens_per_critical_cpu_second"])
            print(f"scaling efficiency, {name} vs 2 x ({one_name}): wall {wall:.2f}, cpu {cpu:.2f} "
                  f"(goal >= 0.85, issue 18)")  # fmt: skip
    fp8 = results.get("2 ranks x 1 core, FP8")
    if two and fp8:
        print(f"FP8 / {args.precision} throughput at 2 ranks: wall {fp8['tokens_per_second'] / two['tokens_per_second']:.2f}x, "
              f"cpu {fp8['tokens_per_critical_cpu_second'] / two['tokens_per_critical_cpu_second']:.2f}x; "
              f"valid NE {args.precision} {two['valid_ne']:.4f} vs FP8 {fp8['valid_ne']:.4f} "
              f"({(fp8['valid_ne'] / two['valid_ne'] - 1):+.2%}); float8 GEMM: {fp8_gemm_line(fp8)}")  # fmt: skip
    for name, eager_name in COMPILED_VS_EAGER.items():
        if name in results and eager_name in results:
            c, e = results[name], results[eager_name]
            print(f"compiled / eager, {eager_name}: tokens/s wall {c['tokens_per_second'] / e['tokens_per_second']:.2f}x, "
                  f"cpu {c['tokens_per_critical_cpu_second'] / e['tokens_per_critical_cpu_second']:.2f}x; valid NE "
                  f"{e['valid_ne']:.4f} -> {c['valid_ne']:.4f} ({c['valid_ne'] / e['valid_ne'] - 1:+.2%}, goal within 0.2%)")  # fmt: skip
    plain = [r for name, r in results.items() if "FP8" not in name]
    if plain:
        print(f"best MFU: wall {max(r['mfu'] for r in plain):.1%}, cpu {max(r['mfu_cpu'] for r in plain):.1%} "
              f"of the {args.precision} peak of the cores used (goal >= 30% at d_model >= 256)")  # fmt: skip
    if args.record:
        record_figures(args, results, peak_wall, peak_cpu)


def record_figures(args, results: dict, peak_wall: float, peak_cpu: float) -> None:
    """The headline figures into docs/benchmarks.md; MFU only against the peak of the precision that ran."""
    p = args.precision
    rows = [(f"1-core {p} GEMM peak (1024^3, 1 thread), the MFU denominator", f"{peak_wall * 1e3:.1f} GFLOP/s wall, {peak_cpu * 1e3:.1f} per CPU-s")]  # fmt: skip
    for name, r in results.items():
        rows.append((f"d {args.d_model}, {name}, {p}: tokens/s wall / cpu, MFU of the {p} peak wall / cpu, valid NE",
                     f"{r['tokens_per_second']:.0f} / {r['tokens_per_critical_cpu_second']:.0f}, "
                     f"{r['mfu']:.1%} / {r['mfu_cpu']:.1%}, {r['valid_ne']:.4f}"))  # fmt: skip
    one, two = results.get("1 rank x 1 core"), results.get("2 ranks x 1 core")
    if one and two:
        wall = two["tokens_per_second"] / (2 * one["tokens_per_second"])
        cpu = two["tokens_per_critical_cpu_second"] / (2 * one["tokens_per_critical_cpu_second"])
        rows.append((f"d {args.d_model}, 2-rank scaling efficiency, {p}", f"{wall:.2f} wall, {cpu:.2f} cpu"))
    record(
        f"train.d{args.d_model}.{p}", f"distributed training, d_model {args.d_model} (bench/train.py)", rows
    )


def print_accounts(results: dict, first: int) -> None:
    """Per configuration and rank: ms per profiled step in each category, and the share outside GEMMs."""
    rows = [
        (name, rank, a)
        for name, r in results.items()
        for rank, a in enumerate(r.get("step_account") or [])
        if a
    ]
    if not rows:
        return
    print(
        f"\nstep account (profiled steps {first}-{first + 3}, ms per step; wall, so a rank's communication "
        "includes waiting):"
    )
    print(
        f"{'configuration':<26} {'rank':>4} {'step':>7} "
        + " ".join(f"{c:>9}" for c in CATEGORIES)
        + f" {'non-GEMM':>8}"
    )
    for name, rank, a in rows:
        ms = a["seconds_per_step"]
        print(f"{name:<26} {rank:>4} {a['profiled_step_seconds'] * 1e3:>7.0f} "
              + " ".join(f"{ms[c] * 1e3:>9.0f}" for c in CATEGORIES) + f" {a['non_gemm_share']:>8.1%}")  # fmt: skip
    for name, r in results.items():
        acc = [a for a in r.get("step_account") or [] if a]
        if acc:
            print(f"  {name}: profiled step {acc[0]['profiled_step_seconds']:.3f} s vs unprofiled median "
                  f"{r['step_seconds_median']:.3f} s (profiler overhead); share outside GEMMs, rank 0: "
                  f"{acc[0]['non_gemm_share']:.1%} (goal <= 40%)")  # fmt: skip


if __name__ == "__main__":
    main()
