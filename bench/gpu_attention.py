"""Triton jagged attention vs padded flash SDPA on one H100/H200: time and achieved TFLOP/s, fwd and fwd+bwd.

One prepared, unattended run (needs CUDA and Triton; exits 1 without them):
1. correctness first: every Triton kernel against ``models.attention.reference`` on a small batch (fp32 and
   bf16, head dims 64 and 128, forward and all gradients, bias tables included); exits 2 on a mismatch,
   before timing anything;
2. the table: maximum lengths 1k / 4k / 8k, Zipf-distributed lengths (log-uniform = Zipf exponent 1, one
   sequence at the maximum; mean fill printed, at most 30%), heads x head dim 8 x 64 and 4 x 128, bf16.
   Cases: bidirectional and causal self-attention, causal self-attention with the relative position + time
   bias, cross-attention with 4 summary queries per history, and 1,024 candidates per request against the
   request's user tokens. Baseline: ``scaled_dot_product_attention`` on the same batch padded to the maximum
   length, flash backend forced through ``torch.nn.attention.sdpa_kernel``; it takes no mask, so it pays for
   the padding and cannot add the bias (what a padded pipeline would pay at best); ``flex ms``: torch's
   FlexAttention on the same jagged batch, packed, bias as a ``score_mod`` (``models.attention.flex``: issue 40
   asks whether the library can replace our kernels). ``TF/s`` counts the useful
   (jagged) work for both, so the two columns compare directly; ``sdpa raw`` counts the padded work SDPA did;
3. if ``models.architectures.user_model`` is present: one training step (fwd + bwd + AdamW, bf16 autocast) of the user
   model's encoder stack (``models.architectures.layers.TransformerBlock``, the layers that call the attention dispatcher;
   the whole model also needs torchrec, which GPU images lack) with backend ``triton`` vs ``padded_sdpa`` (pad +
   bias/mask folded into one ``attn_mask`` + SDPA, the padded pipeline the issue's 1.5x goal is set against),
   ``jagged`` and ``reference``; skipped with a message when those modules are absent or fail.

    python3 bench/gpu_attention.py                  # everything (a few minutes on an H200, much of it compiling)
    python3 bench/gpu_attention.py --quick          # on a GPU: max length 1k only, fewer repetitions
    python3 bench/gpu_attention.py --json rows.json # also write the rows
    TRITON_INTERPRET=1 .venv/bin/python bench/gpu_attention.py --quick   # no GPU: the CPU smoke run (below)

Without a GPU, ``--quick`` (or ``--cpu-smoke``, which forces it) runs the whole script on the CPU with the
kernels interpreted (``TRITON_INTERPRET=1``) at tiny shapes: every check, case and backend once, in about a
minute; its times mean nothing, it proves the script works (a test runs it).

Timing: CUDA events around each call, median of repetitions after two warm-up calls (compilation excluded).
The jagged calls include their host syncs (offset checks, block schedule): a real cost of the jagged path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = ["self-bidir", "self-causal", "self-causal-bias", "cross-summary", "candidates"]
LENGTH_RANGE = 256  # lengths span max_len / 256 .. max_len: mean fill ~18%
MAX_FILL = 0.30
SUMMARY_QUERIES = 4
MAX_REL_POS = 64
TIME_BUCKETS = 32


@dataclass(frozen=True)
class Plan:
    """What to measure; the GPU plan is the default, the CPU smoke plan only exercises the script's logic."""

    device: str = "cuda"
    max_lens: tuple[int, ...] = (1024, 4096, 8192)
    shapes: tuple[tuple[int, int], ...] = ((8, 64), (4, 128))  # (heads, head_dim)
    tokens: int = 1 << 18  # jagged tokens per self-attention batch
    candidates: int = 1024  # per request, in the "candidates" case
    check_lens: tuple[int, ...] = (0, 1, 17, 64, 129, 300, 5)
    check_head_dims: tuple[int, ...] = (64, 128)
    reps: int = 5  # minimum timed repetitions
    warmups: int = 2  # untimed calls first (the first one compiles)
    budget_ms: float = 300.0  # keep repeating until this much time was measured (at most 50 repetitions)
    um_d_model: int = 512
    um_heads: int = 8
    um_layers: int = 4
    um_max_len: int = 1024
    um_tokens: int = 1 << 13  # the padded reference holds (B, H, N, N) fp32 scores per layer


GPU_PLAN = Plan()
QUICK_PLAN = replace(GPU_PLAN, max_lens=(1024,), reps=3, budget_ms=100.0)
CPU_SMOKE_PLAN = Plan(
    device="cpu", max_lens=(32,), shapes=((2, 16),), tokens=96, candidates=4, check_lens=(0, 1, 9, 3),
    check_head_dims=(16,), reps=1, warmups=0, budget_ms=0.0, um_d_model=32, um_heads=2, um_layers=1,
    um_max_len=32, um_tokens=64,
)  # fmt: skip


@dataclass
class Row:
    case: str
    max_len: int
    heads: int
    head_dim: int
    batch: int
    fill: float
    pass_: str  # "fwd" | "fwd+bwd"
    triton_ms: float | None
    sdpa_ms: float | None
    triton_tflops: float | None
    sdpa_tflops: float | None
    sdpa_raw_tflops: float | None
    note: str = ""
    flex_ms: float | None = None  # FlexAttention on the packed batch (models.attention.flex)


# ----------------------------------------------------------------------------------------------- batches


def zipf_lengths(rng: np.random.Generator, max_len: int, target_tokens: int) -> np.ndarray:
    """Log-uniform lengths on [max_len / LENGTH_RANGE, max_len] (Zipf exponent 1), one sequence at max_len so
    the padded baseline pads to max_len; redrawn until the mean fill is at most MAX_FILL."""
    min_len = max(1, max_len // LENGTH_RANGE)
    expected_mean = (max_len - min_len) / math.log(max_len / min_len)
    count = max(4, round(target_tokens / expected_mean))
    for _ in range(100):
        lens = np.exp(rng.uniform(math.log(min_len), math.log(max_len + 1), size=count)).astype(np.int64)
        lens = lens.clip(min_len, max_len)
        lens[0] = max_len
        if lens.mean() / max_len <= MAX_FILL:
            return lens
    raise RuntimeError(f"could not draw lengths with mean fill <= {MAX_FILL} for max_len {max_len}")


def offsets_of(lens: np.ndarray, device) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64, device=device)


def sorted_timestamps(lens: np.ndarray, rng: np.random.Generator, device) -> torch.Tensor:
    """Increasing int64 seconds per sequence; gaps from seconds to months hit every log2 time bucket."""
    total = int(np.sum(lens))
    gaps = (rng.random(total) * 2.0 ** rng.integers(0, 24, total)).astype(np.int64)
    parts = [1_700_000_000 + np.cumsum(g) for g in np.split(gaps, np.cumsum(lens)[:-1])]
    return torch.tensor(np.concatenate(parts) if parts else np.zeros(0), dtype=torch.int64, device=device)


def values(total: int, heads: int, head_dim: int, dtype, device, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(total, heads, head_dim, dtype=dtype, device=device).requires_grad_(requires_grad)


def padded(x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
    """(total, H, D) -> (B, H, max_len, D) contiguous, the layout SDPA wants."""
    from models.attention.reference import pad

    return pad(x.detach(), offsets, max_len)[0].transpose(1, 2).contiguous().requires_grad_(x.requires_grad)


# ----------------------------------------------------------------------------------------------- timing


def time_ms(fn, plan: Plan) -> float:
    """Median time of fn in ms after ``plan.warmups`` untimed calls (the first one compiles)."""
    cuda = plan.device == "cuda"
    for _ in range(plan.warmups):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    while len(times) < plan.reps or (sum(times) < plan.budget_ms and len(times) < 50):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def forward_only(call):
    def run():
        with torch.no_grad():
            call()

    return run


def forward_backward(call, leaves: list[torch.Tensor]):
    upstream = {}

    def run():
        for t in leaves:
            t.grad = None
        out = call()
        if "grad" not in upstream:
            upstream["grad"] = torch.randn_like(out)
        out.backward(upstream["grad"])

    return run


def tflops(flops: float, ms: float | None) -> float | None:
    return flops / (ms * 1e-3) / 1e12 if ms else None


# ----------------------------------------------------------------------------------------------- correctness


def check_correctness(tri, reference, plan: Plan) -> list[str]:
    """Triton vs reference on a small batch, forward and every gradient. Returns the failures."""
    failures = []
    for dtype, tol in ((torch.float32, 2e-4), (torch.bfloat16, 5e-2)):
        for head_dim in plan.check_head_dims:
            failures += _check_one(
                tri, reference, np.array(plan.check_lens), dtype, tol, head_dim, plan.device
            )
    return failures


def _check_one(tri, reference, lens: np.ndarray, dtype, tol: float, head_dim: int, device) -> list[str]:
    rng = np.random.default_rng(head_dim)
    torch.manual_seed(head_dim)
    heads, total = 2, int(lens.sum())
    offsets, ts = offsets_of(lens, device), sorted_timestamps(lens, rng, device)
    q_lens = rng.integers(0, 9, len(lens))
    q_lens[0] = 70  # many candidates for one (here empty) key set
    qkv = [values(total, heads, head_dim, dtype, device, True) for _ in range(3)]
    pos = torch.randn(heads, 2 * 8 + 1, device=device, requires_grad=True)
    tim = torch.randn(heads, 20, device=device, requires_grad=True)
    qx = values(int(q_lens.sum()), heads, head_dim, dtype, device, True)
    q_off = offsets_of(q_lens, device)
    bias = dict(pos_bias=pos, time_bias=tim, timestamps=ts)
    cases = {
        "self": (lambda m: m.jagged_self_attention(*qkv, offsets), qkv),
        "self-causal-bias": (
            lambda m: m.jagged_self_attention(*qkv, offsets, causal=True, **bias),
            [*qkv, pos, tim],
        ),
        "cross": (
            lambda m: m.jagged_cross_attention(qx, q_off, qkv[1], qkv[2], offsets),
            [qx, qkv[1], qkv[2]],
        ),
    }
    failures = []
    for name, (call, leaves) in cases.items():
        results = []
        for module in (reference, tri):
            out = call(module)
            results.append([out, *torch.autograd.grad(out, leaves, torch.ones_like(out) * 0.1)])
        for i, (got, want) in enumerate(zip(results[1], results[0], strict=True)):
            err = (got.float() - want.float()).abs().max().item()
            scale = max(1.0, want.float().abs().max().item())
            ok = err <= tol * scale and bool(torch.isfinite(got).all())
            what = "out" if i == 0 else f"grad[{i - 1}]"
            print(
                f"  {str(dtype):15s} D={head_dim:<4d} {name:17s} {what:8s} err={err:.2e} {'ok' if ok else 'MISMATCH'}"
            )
            if not ok:
                failures.append(f"{dtype} D={head_dim} {name} {what}: {err:.3g} > {tol} x {scale:.3g}")
    return failures


# ----------------------------------------------------------------------------------------------- cases


def run_case(tri, case: str, max_len: int, heads: int, head_dim: int, plan: Plan, rng) -> list[Row]:
    """Both passes of one case at one size: triton on the jagged batch, flash SDPA on the padded one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    device, dtype = torch.device(plan.device), torch.bfloat16
    if case == "candidates":  # many candidates per request against the request's user tokens
        kv_lens = zipf_lengths(rng, max_len, plan.tokens // 8)
        q_lens = np.full_like(kv_lens, plan.candidates)
    else:
        kv_lens = zipf_lengths(rng, max_len, plan.tokens)
        q_lens = np.full_like(kv_lens, SUMMARY_QUERIES) if case == "cross-summary" else kv_lens
    cross = case in ("cross-summary", "candidates")
    causal = case.startswith("self-causal")
    bias = case == "self-causal-bias"
    q_off, kv_off = offsets_of(q_lens, device), offsets_of(kv_lens, device)
    q = values(int(q_lens.sum()), heads, head_dim, dtype, device, True)
    k, v = (values(int(kv_lens.sum()), heads, head_dim, dtype, device, True) for _ in range(2))
    extra, leaves = {}, [q, k, v]
    if bias:
        extra = dict(
            pos_bias=torch.randn(heads, 2 * MAX_REL_POS + 1, device=device, requires_grad=True),
            time_bias=torch.randn(heads, TIME_BUCKETS, device=device, requires_grad=True),
            timestamps=sorted_timestamps(kv_lens, rng, device),
        )
        leaves += [extra["pos_bias"], extra["time_bias"]]

    def triton_call():
        if cross:
            return tri.jagged_cross_attention(q, q_off, k, v, kv_off)
        return tri.jagged_self_attention(q, k, v, kv_off, causal=causal, **extra)

    def flex_call():  # the same jagged batch through torch's FlexAttention (block mask built per call)
        from models.attention import flex

        if cross:
            return flex.jagged_cross_attention(q, q_off, k, v, kv_off)
        return flex.jagged_self_attention(q, k, v, kv_off, causal=causal, **extra)

    q_width = int(q_lens.max())
    qp, kp, vp = padded(q, q_off, q_width), padded(k, kv_off, max_len), padded(v, kv_off, max_len)

    def sdpa_call():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(qp, kp, vp, is_causal=causal)

    pairs = q_lens * kv_lens if cross else (kv_lens * (kv_lens + 1) // 2 if causal else kv_lens**2)
    fwd_flops = 4.0 * heads * head_dim * float(pairs.sum())
    padded_flops = 4.0 * heads * head_dim * q_width * max_len * (0.5 if causal else 1.0) * len(kv_lens)
    rows = []
    for pass_, factor in (("fwd", 1.0), ("fwd+bwd", 3.5)):  # backward = 2.5 x forward (FlashAttention count)
        timings, notes = {}, []
        for name, call, call_leaves in (("triton", triton_call, leaves), ("sdpa", sdpa_call, [qp, kp, vp]),
                                        ("flex", flex_call, leaves)):  # fmt: skip
            run = forward_only(call) if pass_ == "fwd" else forward_backward(call, call_leaves)
            try:
                timings[name] = time_ms(run, plan)
            except Exception as exc:  # one failing measurement must not lose the rest of the table
                timings[name] = None
                notes.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                if plan.device == "cuda":
                    torch.cuda.empty_cache()
        if bias:
            notes.append("sdpa without the bias")
        fill = float(kv_lens.mean() / max_len)
        rows.append(
            Row(
                case, max_len, heads, head_dim, len(kv_lens), fill, pass_, timings["triton"], timings["sdpa"],
                tflops(factor * fwd_flops, timings["triton"]), tflops(factor * fwd_flops, timings["sdpa"]),
                tflops(factor * padded_flops, timings["sdpa"]), "; ".join(notes), timings["flex"],
            )
        )  # fmt: skip
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return format(x, spec) if x is not None else "-"


def print_rows(rows: list[Row], header: bool = True) -> None:
    head = (
        f"{'case':17s} {'max_len':>7s} {'HxD':>6s} {'B':>4s} {'fill':>5s} {'pass':8s} {'triton ms':>10s} "
        f"{'sdpa ms':>9s} {'speedup':>7s} {'triton TF/s':>11s} {'sdpa TF/s':>9s} {'sdpa raw':>8s} {'flex ms':>9s}  note"
    )
    if header:
        print(head)
        print("-" * len(head))
    for r in rows:
        speedup = r.sdpa_ms / r.triton_ms if r.sdpa_ms and r.triton_ms else None
        print(
            f"{r.case:17s} {r.max_len:7d} {f'{r.heads}x{r.head_dim}':>6s} {r.batch:4d} {r.fill:5.2f} {r.pass_:8s} "
            f"{_fmt(r.triton_ms, '10.3f')} {_fmt(r.sdpa_ms, '9.3f')} {_fmt(speedup, '6.2f') + 'x':>7s} "
            f"{_fmt(r.triton_tflops, '11.1f')} {_fmt(r.sdpa_tflops, '9.1f')} {_fmt(r.sdpa_raw_tflops, '8.1f')} "
            f"{_fmt(r.flex_ms, '9.3f')}  "
            f"{r.note}",
            flush=True,
        )


# ----------------------------------------------------------------------------------------------- user model


def user_model_step(plan: Plan) -> list[dict]:
    """One training step of the user model's encoder stack per attention backend; [] when unavailable."""
    if importlib.util.find_spec("models.architectures.user_model") is None:
        print("user-model step: skipped (models.architectures.user_model is not in this checkout)")
        return []
    try:
        from torch import nn

        from models.architectures.layers import TransformerBlock
        from models.config import UserModelConfig
    except Exception as exc:
        print(f"user-model step: skipped ({type(exc).__name__}: {exc})")
        return []
    cfg = UserModelConfig()
    rng = np.random.default_rng(1)
    lens = zipf_lengths(rng, plan.um_max_len, plan.um_tokens)
    offsets = offsets_of(lens, plan.device)
    ts = sorted_timestamps(lens, rng, plan.device)
    x = torch.randn(int(lens.sum()), plan.um_d_model, device=plan.device)
    print(
        f"user-model encoder step: {plan.um_layers} x TransformerBlock(d={plan.um_d_model}, heads={plan.um_heads}, "
        f"causal={cfg.causal}, max_rel_pos={cfg.max_rel_pos}, time_buckets={cfg.time_buckets}), batch {len(lens)}, "
        f"max_len {plan.um_max_len}, {int(lens.sum())} tokens, bf16 autocast, AdamW"
    )
    results = []
    for backend in ("triton", "padded_sdpa", "jagged", "reference"):
        try:
            torch.manual_seed(0)
            blocks = nn.ModuleList(
                TransformerBlock(
                    plan.um_d_model, plan.um_heads, cfg.ffn_mult, 0.0, causal=cfg.causal,
                    max_rel_pos=cfg.max_rel_pos, time_buckets=cfg.time_buckets, backend=backend,
                )
                for _ in range(plan.um_layers)
            ).to(plan.device)  # fmt: skip
            opt = torch.optim.AdamW(blocks.parameters(), lr=1e-4)
            losses: list[torch.Tensor] = []

            def step(blocks=blocks, opt=opt, losses=losses):
                opt.zero_grad(set_to_none=True)
                with torch.autocast(plan.device, dtype=torch.bfloat16):
                    h = x
                    for block in blocks:
                        h = block(h, offsets, ts)
                    loss = h.float().square().mean()
                loss.backward()
                opt.step()
                losses.append(loss.detach())

            if plan.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            ms = time_ms(step, plan if plan.device == "cpu" else replace(plan, reps=max(plan.reps, 3)))
            peak = torch.cuda.max_memory_allocated() / 2**30 if plan.device == "cuda" else float("nan")
            first_loss = losses[0].item()
            print(f"  {backend:9s} {ms:9.2f} ms/step   peak {peak:6.2f} GiB   first loss {first_loss:.6f}")
            results.append({"backend": backend, "ms": ms, "peak_gib": peak, "first_loss": first_loss})
            del blocks, opt
        except Exception as exc:
            print(f"  {backend:9s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            results.append({"backend": backend, "error": f"{type(exc).__name__}: {exc}"[:500]})
        if plan.device == "cuda":
            torch.cuda.empty_cache()
    timed = {r["backend"]: r["ms"] for r in results if "ms" in r}
    for baseline in ("padded_sdpa", "reference"):
        if "triton" in timed and baseline in timed:
            print(f"  triton step is {timed[baseline] / timed['triton']:.2f}x faster than {baseline}"
                  + (" (goal >= 1.5x)" if baseline == "padded_sdpa" else ""))  # fmt: skip
    return results


# ----------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="GPU: max length 1k only; no GPU: the CPU smoke run"
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on a CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--skip-user-model", action="store_true")
    parser.add_argument("--json", type=Path, help="write all rows and the user-model step here")
    args = parser.parse_args()
    if args.cpu_smoke or (args.quick and not torch.cuda.is_available()):
        plan = CPU_SMOKE_PLAN
    else:
        plan = QUICK_PLAN if args.quick else GPU_PLAN
    if plan.device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("the CPU smoke run interprets the kernels: set TRITON_INTERPRET=1 (before Python starts)")
        return 1

    if plan.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench/gpu_attention.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured."
        )
        return 1
    try:
        import triton
    except ImportError:
        print("bench/gpu_attention.py needs Triton (pip install triton); nothing measured.")
        return 1
    from models.attention import reference
    from models.attention import triton as tri

    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        where = f"GPU {props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        where = "CPU smoke run (interpreted kernels; times mean nothing)"
    print(f"{where}, torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}")

    print("correctness vs models.attention.reference (small batch, fp32 + bf16, outputs and all gradients):")
    failures = check_correctness(tri, reference, plan)
    if failures:
        print("MISMATCH - not timing a wrong kernel:\n  " + "\n  ".join(failures))
        return 2

    rows: list[Row] = []
    rng = np.random.default_rng(2026)
    print(
        f"\nbf16, ~{plan.tokens} jagged tokens per self-attention batch; TF/s = useful (jagged) work / time"
    )
    for max_len in plan.max_lens:
        for heads, head_dim in plan.shapes:
            for case in CASES:
                try:
                    new = run_case(tri, case, max_len, heads, head_dim, plan, rng)
                except Exception as exc:
                    traceback.print_exc()
                    note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    new = [
                        Row(case, max_len, heads, head_dim, 0, 0.0, p, None, None, None, None, None, note)
                        for p in ("fwd", "fwd+bwd")
                    ]
                print_rows(new, header=not rows)  # progress; the whole table again at the end
                rows += new
                if plan.device == "cuda":
                    torch.cuda.empty_cache()
    print("\nall cases:")
    print_rows(rows)

    user_model: list[dict] = []
    if not args.skip_user_model:
        try:
            user_model = user_model_step(plan)
        except Exception as exc:  # the kernel table above is the main result: keep it
            traceback.print_exc()
            user_model = [{"error": f"{type(exc).__name__}: {exc}"[:500]}]
    if args.json:
        args.json.write_text(
            json.dumps({"rows": [asdict(r) for r in rows], "user_model": user_model}, indent=1)
        )
        print(f"rows written to {args.json}")
    broken = [r for r in rows if r.triton_ms is None]
    if broken:
        print(f"{len(broken)} triton measurements failed (see the notes column)")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
