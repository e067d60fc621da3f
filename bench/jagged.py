"""Jagged attention vs the padded reference on Zipf-distributed lengths: step time and peak memory, side by side.

Each (case, backend) runs in its own fresh Python process, so its peak resident memory (``ru_maxrss``) is its own;
the table reports that peak minus the process's resident memory just before the first step (the inputs and the
interpreter are excluded, everything the step allocates, torch's allocations included, is counted). One warm-up
step, then the median of ``--steps`` timed forward + backward steps.

    .venv/bin/python bench/jagged.py                      # batch 64, heads 4, head dim 32, lengths <= 1024
    .venv/bin/python bench/jagged.py --batch 16 --steps 2 # quicker
    .venv/bin/python bench/jagged.py --threads 1          # steadier on a shared, busy machine
    .venv/bin/python bench/jagged.py --backends reference,jagged,flex --forward-only  # torch's FlexAttention too

FlexAttention (``models.attention.flex``) has no backward on CPU (torch 2.13: ``NotImplementedError``), so it is
measured forward only (``--forward-only``: no gradients anywhere, the serving/evaluation case); its step includes
building the block mask, which changes with every batch's lengths, and its first (compiling) call is the warm-up.

On a machine shared with other jobs the times swing (a 2-thread step of many small kernels suffers most
from oversubscription); the load average printed with the settings says how busy it was.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import add_record_flag, record  # noqa: E402

from models.attention import dispatch  # noqa: E402
from models.attention.jagged_layout import plan_cross, plan_self  # noqa: E402

CASES = {
    "self-causal-bias": "causal self-attention + relative position and time bias (the user model's layer)",
    "self-bidir": "bidirectional self-attention, no bias",
    "cross": "jagged queries (1-64 per sequence) over jagged keys/values",
}
BACKENDS = ("reference", "jagged", "flex")


@dataclass
class Settings:
    batch: int = 64
    heads: int = 4
    head_dim: int = 32
    max_len: int = 1024
    zipf: float = 0.6  # exponent s of P(len = k) ~ k^-s on 1..max_len; 0.6 keeps mean fill just under 30%
    max_queries: int = 64  # cross-attention: queries per sequence, uniform on 1..max_queries
    pos_buckets: int = 128  # relative position bias covers |i - j| <= this
    time_buckets: int = 32
    steps: int = 3
    dtype: str = "float32"
    seed: int = 0
    threads: int = 0  # torch intra-op threads per worker; 0 keeps torch's default


def zipf_lengths(n: int, max_len: int, s: float, gen: torch.Generator) -> torch.Tensor:
    """n lengths on 1..max_len with P(k) proportional to k^-s."""
    weights = torch.arange(1, max_len + 1, dtype=torch.float64).pow(-s)
    return torch.multinomial(weights, n, replacement=True, generator=gen) + 1


def offsets_of(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([lens.new_zeros(1), lens.cumsum(0)])


def make_inputs(case: str, cfg: Settings, grad: bool = True) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Leaf tensors and the kwargs of one call; returns (call kwargs, key lengths, query lengths)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    lens = zipf_lengths(cfg.batch, cfg.max_len, cfg.zipf, gen)
    offsets = offsets_of(lens)
    total = int(offsets[-1])

    def leaf(rows: int) -> torch.Tensor:
        return torch.randn(rows, cfg.heads, cfg.head_dim, generator=gen).to(dtype).requires_grad_(grad)

    if case == "cross":
        q_lens = torch.randint(1, cfg.max_queries + 1, (cfg.batch,), generator=gen)
        q_offsets = offsets_of(q_lens)
        call = dict(
            q=leaf(int(q_offsets[-1])), q_offsets=q_offsets, k=leaf(total), v=leaf(total), kv_offsets=offsets
        )
        return call, lens, q_lens
    call = dict(
        q=leaf(total), k=leaf(total), v=leaf(total), offsets=offsets, causal=case == "self-causal-bias"
    )
    if case == "self-causal-bias":
        gaps = torch.randint(0, 86_400, (total,), generator=gen)
        call |= dict(
            pos_bias=(0.1 * torch.randn(cfg.heads, 2 * cfg.pos_buckets + 1, generator=gen)).requires_grad_(
                grad
            ),
            time_bias=(0.1 * torch.randn(cfg.heads, cfg.time_buckets, generator=gen)).requires_grad_(grad),
            timestamps=gaps.cumsum(0),  # increasing within each sequence, like event times
        )
    return call, lens, lens


def step(case: str, backend: str, call: dict, backward: bool) -> None:
    if backend == "flex":  # measured only, not a backend the models dispatch to
        from models.attention import flex

        op = flex.jagged_cross_attention if case == "cross" else flex.jagged_self_attention
    else:
        op = partial(dispatch.jagged_cross_attention if case == "cross" else dispatch.jagged_self_attention,
                     backend=backend)  # fmt: skip
    out = op(**call)
    if backward:
        out.float().square().mean().backward()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(case: str, backend: str, cfg: Settings, backward: bool) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    call, _, _ = make_inputs(case, cfg, grad=backward)
    before = rss_bytes()
    step(case, backend, call, backward)  # warm-up: first calls pay for lazy init, allocator growth, compiling
    times = []
    for _ in range(cfg.steps):
        for t in call.values():
            if isinstance(t, torch.Tensor):
                t.grad = None
        start = time.perf_counter()
        step(case, backend, call, backward)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"step_ms": 1e3 * statistics.median(times), "peak_mib": (peak - before) / 2**20}


def layout_figures(case: str, cfg: Settings) -> dict:
    """How much each layout computes on: attention cells (query x key pairs, padding included) / real cells."""
    _, kv_lens, q_lens = make_inputs(case, cfg)
    real = float((q_lens * kv_lens).sum())
    padded_ref = cfg.batch * float(q_lens.max()) * float(kv_lens.max())
    if case == "cross":
        q_plan, kv_plan = plan_cross(offsets_of(q_lens), offsets_of(kv_lens))
        pairs = zip(q_plan.buckets, kv_plan.buckets, strict=True)
    else:
        plan = plan_self(offsets_of(kv_lens))
        pairs = zip(plan.buckets, plan.buckets, strict=True)
    jagged_cells = sum(q.size * kv.max_len for q, kv in pairs)
    return {
        "mean_fill": float(kv_lens.float().mean()) / float(kv_lens.max()),
        "max_len": int(kv_lens.max()),
        "buckets": len(kv_plan.buckets if case == "cross" else plan.buckets),
        "ref_cells_over_real": padded_ref / real,
        "jagged_cells_over_real": jagged_cells / real,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, default in asdict(Settings()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    parser.add_argument(
        "--backends", default="reference,jagged", help=f"comma-separated subset of {BACKENDS}"
    )
    parser.add_argument("--forward-only", action="store_true", help="no backward pass (FlexAttention on CPU)")
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "BACKEND"), help=argparse.SUPPRESS)
    add_record_flag(parser)
    args = parser.parse_args()
    cfg = Settings(**{k: getattr(args, k) for k in asdict(Settings())})
    if args.worker:
        print(json.dumps(worker(*args.worker, cfg, backward=not args.forward_only)))
        return

    cases, backends = args.cases.split(","), args.backends.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; choose from {list(CASES)}")
    if set(backends) - set(BACKENDS):
        parser.error(
            f"unknown backend(s) {sorted(set(backends) - set(BACKENDS))}; choose from {list(BACKENDS)}"
        )
    if "flex" in backends and not args.forward_only:
        parser.error(
            "FlexAttention has no backward on CPU (torch raises NotImplementedError): add --forward-only"
        )
    threads = cfg.threads or torch.get_num_threads()
    load = os.getloadavg()[0]
    print(f"settings: {asdict(cfg)}; torch {torch.__version__}, {threads} threads; load average {load:.1f}")
    rows = []
    for case in cases:
        layout = layout_figures(case, cfg)
        print(
            f"{case}: {CASES[case]}; max len {layout['max_len']}, mean fill {layout['mean_fill']:.0%}, "
            f"{layout['buckets']} buckets; attention cells / real: reference {layout['ref_cells_over_real']:.2f}, "
            f"jagged {layout['jagged_cells_over_real']:.3f}",
            flush=True,
        )
        result = {}
        for backend in backends:
            cmd = [sys.executable, __file__, "--worker", case, backend, *sys.argv[1:]]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                sys.exit(f"{case}/{backend} failed:\n{done.stderr[-3000:]}")
            result[backend] = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append((case, result))

    base = backends[0]
    step_kind = "forward" if args.forward_only else "forward + backward"
    print(f"\n{step_kind} step: ms and peak MiB per backend; x = {base}'s time / this backend's")
    header = f"{'case':<18}" + "".join(f"{b + ' ms':>14} {'x':>6} {b + ' MiB':>14}" for b in backends)
    print(header + "\n" + "-" * len(header))
    for case, r in rows:
        print(f"{case:<18}" + "".join(
            f"{r[b]['step_ms']:>14.1f} {r[base]['step_ms'] / r[b]['step_ms']:>5.2f}x {r[b]['peak_mib']:>14.1f}"
            for b in backends))  # fmt: skip
    if args.record:
        figures = [(f"{case}, {step_kind} step ms / peak MiB, {' vs '.join(backends)}",
                    " vs ".join(f"{r[b]['step_ms']:.1f}" for b in backends) + " ms; "
                    + " vs ".join(f"{r[b]['peak_mib']:.0f}" for b in backends) + " MiB") for case, r in rows]  # fmt: skip
        key = "jagged" + ("" if backends == ["reference", "jagged"] else "." + "-".join(backends))
        key += ".forward" if args.forward_only else ""
        record(key, f"jagged attention backends, CPU, {step_kind} (bench/jagged.py)", figures)


if __name__ == "__main__":
    main()
