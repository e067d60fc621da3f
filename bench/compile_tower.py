"""Eager vs compiled dense tower (``models.inference.compile``), side by side in one process: CPU ms per training step.

    OMP_NUM_THREADS=1 .venv/bin/python bench/compile_tower.py [--d-model 256] [--layers 2] [--tokens 8192]

The user model's transformer blocks (jagged causal self-attention with relative position + time-gap biases)
plus a target-aware block, forward + backward in bf16 on one thread, on the same jagged batches (lengths drawn
like the bench's histories, up to ``--max-len``). The two copies share nothing but their initial weights. Steps
alternate eager / compiled, so a neighbour's load hits both alike; the figure is the median CPU time per step
(``time.process_time``: what the step costs this core, whatever else runs). The compiled copy's first call is
timed apart (compile, or a hit in inductor's cache under ``.cache/inductor``), and the outputs are compared.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import add_record_flag, record  # noqa: E402

from models.architectures.layers import TargetAwareBlock, TransformerBlock  # noqa: E402
from models.inference.compile import compile_dense, compile_seconds  # noqa: E402


class Tower(torch.nn.Module):
    """L history blocks, then K=4 summary tokens per user read by a target-aware block (the user model's shape)."""

    def __init__(self, d: int, layers: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            TransformerBlock(d, 4, 4, 0.0, causal=True, max_rel_pos=64, time_buckets=32, backend="jagged")
            for _ in range(layers)
        )
        self.target = TargetAwareBlock(d, 4, 4, 0.0, backend="jagged")

    def forward(self, x, offsets, ts, cand):
        for block in self.blocks:
            x = block(x, offsets, ts)
        b = offsets.numel() - 1
        pooled = torch.zeros(b, x.shape[1], dtype=x.dtype).index_add_(
            0, torch.repeat_interleave(torch.arange(b), offsets.diff()), x
        )
        one_each = torch.arange(b + 1)  # one candidate per user, reading the user's pooled token
        return self.target(cand, one_each, self.target.context_kv(pooled), one_each)


def batch(gen, d: int, tokens: int, max_len: int):
    lens = torch.randint(1, max_len + 1, (tokens,), generator=gen)
    lens = lens[: int((lens.cumsum(0) <= tokens).sum())]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    total = int(offsets[-1])
    x = torch.randn(total, d, generator=gen).to(torch.bfloat16).requires_grad_()
    ts = torch.cumsum(torch.randint(1, 3600, (total,), generator=gen), 0)
    cand = torch.randn(len(lens), d, generator=gen).to(torch.bfloat16)
    return x, offsets, ts, cand


def step(model, inputs) -> tuple[float, torch.Tensor]:
    start = time.process_time()
    out = model(*inputs)
    out.float().square().mean().backward()
    return time.process_time() - start, out.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    add_record_flag(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    eager = Tower(args.d_model, args.layers).to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    regions = compile_dense(compiled, "on")
    gen = torch.Generator().manual_seed(0)
    first = batch(gen, args.d_model, args.tokens, args.max_len)
    t0 = time.perf_counter()
    step(compiled, first)
    first_call = time.perf_counter() - t0
    step(eager, first)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    worst = 0.0
    for i in range(args.steps):
        inputs = batch(gen, args.d_model, args.tokens, args.max_len)
        order = (("eager", eager), ("compiled", compiled))[:: 1 if i % 2 == 0 else -1]
        outs = {}
        for name, model in order:
            seconds, outs[name] = step(model, inputs)
            times[name].append(seconds)
        worst = max(worst, float((outs["eager"].float() - outs["compiled"].float()).abs().max()))
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    print(
        f"d_model {args.d_model}, {args.layers} blocks + target block, ~{args.tokens} tokens/step, bf16, 1 thread"
    )
    print(f"compiled regions: {len(regions)} ({', '.join(sorted({r.split('.', 1)[-1] for r in regions}))})")
    print(
        f"first compiled call {first_call:.1f} s wall (compiler {compile_seconds():.1f} s; cached runs skip most)"
    )
    print(f"CPU ms per fwd+bwd step, median of {args.steps}: eager {e * 1e3:.0f}, compiled {c * 1e3:.0f} "
          f"-> compiled/eager {c / e:.2f}x time ({e / c:.2f}x speed); max |out diff| {worst:.2e}")  # fmt: skip
    if args.record:
        what = f"d {args.d_model}, {args.layers} blocks, CPU ms per fwd+bwd step"
        rows = [(f"eager, {what}", f"{e * 1e3:.0f} ms"), (f"compiled, {what}", f"{c * 1e3:.0f} ms"),
                ("first compiled call (wall)", f"{first_call:.1f} s")]  # fmt: skip
        record(
            f"compile_tower.d{args.d_model}", "eager vs compiled dense tower (bench/compile_tower.py)", rows
        )


if __name__ == "__main__":
    main()
