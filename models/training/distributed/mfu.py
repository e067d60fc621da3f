"""FLOPs per training step, the machine's matmul peak, and model-FLOPs utilisation (MFU).

``user_model_flops`` is an analytic count of the matmul FLOPs of one user-model step (2 per multiply-add;
backward = 2 x forward), from the batch's jagged history lengths. It counts useful work: each sequence's own
length (no bucket padding), MoE experts at ``top_k`` per token (not the capacity slots). A test checks it
against ``torch.utils.flop_counter.FlopCounterMode`` on a real forward + backward.

MFU = model FLOPs per step / step time / peak, where the peak is a dense GEMM measured on this machine with
all its cores (``measure_matmul_peak``; ``bench/matmul_peak.py`` prints it for bf16 and fp32).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula, sdpa_flop

from models.config import UserModelConfig
from models.training.batch import CANDIDATE_ID_FIELDS

aten = torch.ops.aten

# The fused CPU attention kernel has no entry in FlopCounterMode's table (only CUDA's flash/efficient do), so
# it would count 0; it computes the same products as any SDPA.
if aten._scaled_dot_product_flash_attention_for_cpu.default not in torch.utils.flop_counter.flop_registry:

    @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
    def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop(query_shape, key_shape, value_shape)


def user_model_flops(
    cfg: UserModelConfig,
    history_lengths: Sequence[int],
    *,
    num_dense: int,
    candidates: int | None = None,
    moe_top_k: int = 1,
    training: bool = True,
) -> float:
    """Matmul FLOPs of one forward (+ backward when ``training``) of the user model on one batch.

    ``history_lengths``: each user's history length (already clipped to ``max_history``); ``candidates``:
    scored candidates (default one per user, as in training batches).
    """
    d, m, k = cfg.d_model, cfg.ffn_mult, cfg.num_user_tokens
    lens = [int(n) for n in history_lengths]
    users, tokens = len(lens), sum(lens)
    n = users if candidates is None else candidates
    kinds = cfg.ffn or ["dense"] * cfg.num_layers
    fwd = 0.0
    if cfg.pooling == "transformer":
        attention = sum(4 * n_i * n_i * d for n_i in lens)  # QK^T and AV per sequence
        for kind in kinds:
            fwd += 8 * tokens * d * d + attention  # qkv (3d) + out projections
            fwd += 4 * m * tokens * d * d * (moe_top_k if kind == "moe" else 1)
        # summary: K queries per user cross-attend over the user's states
        fwd += 4 * users * k * d * d + 4 * tokens * d * d + 4 * k * tokens * d
    else:
        k = 1
    # candidate tower: projection of its feature tokens, target-aware block over the K user tokens, MLP head
    feature_tokens = len(CANDIDATE_ID_FIELDS) + num_dense
    fwd += 2 * n * feature_tokens * d * d
    fwd += 4 * n * d * d + 4 * users * k * d * d + 4 * n * k * d + 4 * m * n * d * d
    fwd += 8 * n * d * d + 8 * n * d
    if training and cfg.next_event_weight > 0 and cfg.pooling == "transformer":
        sources = sum(max(n_i - 1, 0) for n_i in lens)
        fwd += 2 * sources * d * d + 2 * sources * d * cfg.num_negatives
    return 3 * fwd if training else fwd


def counted_flops(fn) -> int:
    """FLOPs that FlopCounterMode sees while ``fn()`` runs (forward and, if ``fn`` calls it, backward)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def measure_matmul_peak(
    dtype: torch.dtype, size: int = 2048, seconds: float = 2.0, threads: int = 0, *, cpu_time: bool = False
) -> float:
    """Sustained FLOP/s of a square GEMM in ``dtype`` (after a warm-up), on ``threads`` (0 = torch's default):
    the faster of the right operand row-major and column-major (an ``nn.Linear`` weight's layout; without bf16
    hardware PyTorch's bf16 GEMM is ~9x faster that way), ``seconds`` in all.

    ``cpu_time``: FLOP per CPU-second of this process instead of per wall second (with 1 thread: one core's
    peak while it runs, whatever else the machine runs; the denominator of CPU-time MFU on a shared machine).
    """
    clock = time.process_time if cpu_time else time.perf_counter
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        return max(_gemm_rate(a, right, seconds / 2, clock) for right in (b, b.t().contiguous().t()))
    finally:
        torch.set_num_threads(previous)


def _gemm_rate(a: torch.Tensor, b: torch.Tensor, seconds: float, clock) -> float:
    for _ in range(2):
        torch.mm(a, b)
    runs, start = 0, clock()
    while True:
        torch.mm(a, b)
        runs += 1
        elapsed = clock() - start
        if elapsed >= seconds:
            return 2.0 * a.shape[0] ** 3 * runs / elapsed


def best_seconds(fn, reps: int = 3, give_up: float | None = None) -> float:
    """Wall seconds of the fastest of ``reps`` calls after a warm-up; a warm-up slower than ``give_up``
    seconds is the answer (a cliff needs no second look)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if give_up is not None and first > give_up:
        return first
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def mfu(flops_per_step: float, step_seconds: float, peak_flops: float) -> float:
    return flops_per_step / step_seconds / peak_flops if step_seconds > 0 and peak_flops > 0 else float("nan")
