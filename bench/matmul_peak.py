"""Dense GEMM peak of this machine (bf16 and fp32): the denominator of the training MFU.

    .venv/bin/python bench/matmul_peak.py [--sizes 1024 2048] [--seconds 3] [--threads 0]

Prints GFLOP/s per dtype and size on ``--threads`` threads (0 = all cores), per wall second and per CPU second
of this process (on a shared machine the wall figure measures the neighbours; per CPU second, 1 thread gives
one core's peak while it runs), and the best of each dtype. Training MFU is quoted against the peak of the
precision the run used (``distributed.precision``: bf16 where this CPU multiplies bf16 at least as fast as fp32).
``gemflow train --nproc N`` measures the same GEMM quickly at launch unless ``distributed.peak_tflops`` is set;
pass this script's figure for that precision there for a steadier MFU on a busy machine.
"""

from __future__ import annotations

import argparse
import os

import torch
from report import add_record_flag, record

from models.training.distributed.mfu import measure_matmul_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=0, help="0 = all cores")
    add_record_flag(parser)
    args = parser.parse_args()
    threads = args.threads or os.cpu_count() or 1
    print(f"torch {torch.__version__}, {threads} thread(s) of {os.cpu_count()} core(s)")
    print(f"{'dtype':>8} {'size':>6} {'GFLOP/s':>10} {'per CPU-s':>10}")
    best, rows = {}, []
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        for size in args.sizes:
            flops = measure_matmul_peak(dtype, size=size, seconds=args.seconds, threads=threads)
            cpu = measure_matmul_peak(dtype, size=size, seconds=args.seconds, threads=threads, cpu_time=True)
            best[name] = max(best.get(name, 0.0), flops)
            print(f"{name:>8} {size:>6} {flops / 1e9:>10.1f} {cpu / 1e9:>10.1f}")
            rows.append(
                (
                    f"{name} GEMM {size}x{size}, {threads} thread(s)",
                    f"{flops / 1e9:.1f} GFLOP/s wall, {cpu / 1e9:.1f} per CPU-s",
                )
            )
    for name, flops in best.items():
        print(f"peak {name}: {flops / 1e12:.4f} TFLOP/s  (distributed.peak_tflops={flops / 1e12:.4f})")
    if args.record:
        record(f"matmul_peak.t{threads}", f"GEMM peak, {threads} thread(s) (bench/matmul_peak.py)", rows)


if __name__ == "__main__":
    main()
