"""bf16 linear layers on CPU with a new row count every step, plain vs row-bucketed, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/row_buckets.py [--d-model 256] [--rows 7000] [--steps 60]

Each step draws a row count within +-10% of ``--rows`` (as the distributed trainer's token count moves from step
to step) and runs the forward and backward of the dense tower's linear shapes (d -> 3d, d -> 4d, 4d -> d) with
``nn.Linear`` and with ``models.inference.row_buckets.RowBucketedLinear``, alternating. Prints CPU ms per step (median
after ``--warmup`` steps) and the distinct GEMM row counts each one met: oneDNN compiles and caches a kernel per
GEMM shape, so the plain layers pay a compile on most steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from report import add_record_flag, record
from torch import nn

from models.inference.row_buckets import bucket_linear_rows, bucket_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--rows", type=int, default=7000)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    add_record_flag(parser)
    args = parser.parse_args()
    d = args.d_model
    torch.manual_seed(0)
    shapes = [(d, 3 * d), (d, 4 * d), (4 * d, d)]
    plain = nn.ModuleList(nn.Linear(i, o) for i, o in shapes).bfloat16()
    bucketed = nn.ModuleList(nn.Linear(i, o) for i, o in shapes).bfloat16()
    bucket_linear_rows(bucketed)
    rng = random.Random(0)
    counts = [rng.randint(int(args.rows * 0.9), int(args.rows * 1.1)) for _ in range(args.steps)]
    xs = {i: torch.randn(max(counts), i, dtype=torch.bfloat16) for i, _ in shapes}
    times: dict[str, list[float]] = {"plain": [], "bucketed": []}
    for step, rows in enumerate(counts):
        for name, layers in (("plain", plain), ("bucketed", bucketed)):
            start = time.process_time()
            for layer in layers:
                x = xs[layer.in_features][:rows].requires_grad_()
                layer(x).float().sum().backward()
            if step >= args.warmup:
                times[name].append((time.process_time() - start) * 1e3)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); bf16 linears {shapes} (in, out), "
          f"rows {min(counts)}-{max(counts)} over {args.steps} steps, CPU ms per step (fwd + bwd of all three)")  # fmt: skip
    distinct = {"plain": len(set(counts)), "bucketed": len({bucket_rows(m) for m in counts})}
    for name, ms in times.items():
        print(
            f"  {name:9s} median {statistics.median(ms):7.2f}  mean {statistics.mean(ms):7.2f} ms   "
            f"{distinct[name]:3d} distinct row counts"
        )
    ratio = statistics.median(times["plain"]) / statistics.median(times["bucketed"])
    print(f"  plain / bucketed: {ratio:.2f}x")
    if args.record:
        what = f"d {d}, ~{args.rows} rows, CPU ms per fwd+bwd step"
        rows = [(f"{name}, {what}", f"{statistics.median(ms):.1f} ms") for name, ms in times.items()]
        record(f"row_buckets.d{d}", "bf16 linears with varying row counts (bench/row_buckets.py)", rows)


if __name__ == "__main__":
    main()
