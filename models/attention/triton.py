"""Triton kernels for jagged attention (the GPU fast path behind ``models.attention.dispatch``).

Same contract as ``models.attention.reference``: values (total, H, D) + offsets (B + 1,), never a padded copy.
The kernels read the offsets themselves and run flash-style (online softmax, fp32 accumulation):

- one program per (query block, head); the query blocks of all sequences form one flattened schedule,
  heaviest first, so a batch of Zipf-distributed lengths wastes no program on padding;
- self-attention adds the relative position / time bias inside the kernel from the two small bias tables
  and the timestamps; its backward also returns the gradients of those tables;
- cross-attention is the same kernel with separate query and key offsets, no mask and no bias.

Backward is FlashAttention-2 style: ``delta = rowsum(dO * O)``, one kernel for dK/dV (program per key block,
looping over queries) and one for dQ (program per query block, looping over keys), which also accumulates the
bias-table gradients.

Works on torch 2.11 + Triton 3.6 and newer; only long-standing Triton APIs are used (checked: torch 2.11.0 +
Triton 3.6.0 and torch 2.13.0 + Triton 3.9.0 pass the interpreter-mode tests and compile for sm_90). On a CPU it
runs under ``TRITON_INTERPRET=1`` (set before Triton is imported), which is how the tests check it. Triton 3.6's
interpreter needs NumPy < 2.4: it turns loop bounds into ints with ``int()`` on one-element arrays, which NumPy
2.4 refuses (Triton 3.9 squeezes them first); compiled GPU runs never take that path.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from models.attention import validate

# Finite "minus infinity": masked scores use it so that fully masked (padding) rows never produce NaNs.
_NEG = tl.constexpr(-1.0e30)
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------------------------- kernels
# Kernel signatures stay grouped by role (tensors, offsets, strides, sizes, flags), hence no formatter here.
# fmt: off


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Triton's CPU interpreter multiplies bf16 tiles as their raw uint16 bits; upcasting first gives the
    # same result as the GPU (bf16 products are exact in fp32, accumulation is fp32 on both).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _pos_bucket(rel, max_rel):
    return tl.minimum(tl.maximum(rel, -max_rel), max_rel) + max_rel


@triton.jit
def _time_bucket(ts_row, ts_col, num_buckets):
    """clamp(floor(log2(1 + |ts_row - ts_col|)), 0, T - 1) for a (rows, cols) tile, exactly.

    The difference is taken in the timestamps' own dtype (as the reference does), then floor(log2(x)) for
    x >= 1 is read from the float64 exponent bits: exact, unlike an approximate log2 near powers of two.
    """
    x = 1.0 + tl.abs((ts_row[:, None] - ts_col[None, :]).to(tl.float64))
    exponent = (x.to(tl.int64, bitcast=True) >> 52) - 1023
    return tl.minimum(tl.maximum(exponent, 0), num_buckets - 1).to(tl.int32)


@triton.jit
def _add_by_bucket(acc, bucket, ds, valid, BINS: tl.constexpr):
    """acc[t] += sum of ds over the tile's entries whose bucket is t (only buckets present are visited)."""
    lo = tl.min(tl.min(tl.where(valid, bucket, BINS), 1), 0)
    hi = tl.max(tl.max(tl.where(valid, bucket, -1), 1), 0)
    bins = tl.arange(0, BINS)
    for t in range(lo, hi + 1):
        total = tl.sum(tl.sum(tl.where(bucket == t, ds, 0.0), 1), 0)
        acc += tl.where(bins == t, total, 0.0)
    return acc


@triton.jit
def _score_bias(
    s, rel, ts_row, ts_col, h,
    pos_bias, stride_pos_h, max_rel, time_bias, stride_time_h, num_time_buckets,
    HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
):
    """Adds pos_bias[h, pos_bucket(i - j)] + time_bias[h, time_bucket(ts_i - ts_j)] to a score tile.

    ``rel`` is the tile of i - j in the tile's own layout; the time bucket only needs |ts_i - ts_j|, so
    ``ts_row`` / ``ts_col`` are the timestamps along the tile's rows / columns, whichever side they are.
    """
    if HAS_POS:
        bucket = _pos_bucket(rel, max_rel)
        s += tl.load(pos_bias + h * stride_pos_h + bucket).to(tl.float32)
    if HAS_TIME:
        bucket = _time_bucket(ts_row, ts_col, num_time_buckets)
        s += tl.load(time_bias + h * stride_time_h + bucket).to(tl.float32)
    return s


@triton.jit
def _fwd_kernel(
    Q, K, V, OUT, OUT32, LSE,
    q_offsets, kv_offsets, sched_seq, sched_start,
    pos_bias, time_bias, ts,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_pos_h, stride_time_h, max_rel, num_time_buckets,
    num_heads, head_dim, sm_scale,
    CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, STORE_OUT32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    h = pid % num_heads  # heads vary fastest: the heaviest query blocks of every head start first
    blk = pid // num_heads
    seq = tl.load(sched_seq + blk)
    m_start = tl.load(sched_start + blk)
    q_begin = tl.load(q_offsets + seq)
    q_len = (tl.load(q_offsets + seq + 1) - q_begin).to(tl.int32)
    kv_begin = tl.load(kv_offsets + seq)
    kv_len = (tl.load(kv_offsets + seq + 1) - kv_begin).to(tl.int32)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < head_dim
    q_rows = q_begin + offs_m  # int64: total * stride can exceed 2**31
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    ts_q = tl.load(ts + q_rows, mask=row_ok, other=0) if HAS_TIME else 0

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(kv_len, m_start + BLOCK_M) if CAUSAL else kv_len
    for n_start in range(0, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < kv_len
        kv_rows = kv_begin + offs_n
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * sm_scale
        ts_k = tl.load(ts + kv_rows, mask=col_ok, other=0) if HAS_TIME else 0
        s = _score_bias(s, offs_m[:, None] - offs_n[None, :], ts_q, ts_k, h, pos_bias, stride_pos_h, max_rel,
                        time_bias, stride_time_h, num_time_buckets, HAS_POS, HAS_TIME)
        valid = col_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        s = tl.where(valid, s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    has_keys = l_i > 0.0  # a cross-attention query whose sequence has no keys returns zeros
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), 0.0)
    tl.store(OUT + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    if STORE_OUT32:  # contiguous (total, H, D) fp32 copy, see _JaggedAttention
        tl.store(OUT32 + (q_rows[:, None] * num_heads + h) * head_dim + offs_d[None, :], out,
                 mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + q_rows * num_heads + h, lse, mask=row_ok)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA,
    q_offsets, kv_offsets, sched_seq, sched_start,
    pos_bias, time_bias, ts,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    stride_pos_h, stride_time_h, max_rel, num_time_buckets,
    num_heads, head_dim, sm_scale,
    CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program per (key block, head): loops over the queries that see these keys; works transposed."""
    pid = tl.program_id(0)
    h = pid % num_heads
    blk = pid // num_heads
    seq = tl.load(sched_seq + blk)
    n_start = tl.load(sched_start + blk)
    q_begin = tl.load(q_offsets + seq)
    q_len = (tl.load(q_offsets + seq + 1) - q_begin).to(tl.int32)
    kv_begin = tl.load(kv_offsets + seq)
    kv_len = (tl.load(kv_offsets + seq + 1) - kv_begin).to(tl.int32)

    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < kv_len
    d_ok = offs_d < head_dim
    kv_rows = kv_begin + offs_n
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + kv_rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + kv_rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    ts_k = tl.load(ts + kv_rows, mask=col_ok, other=0) if HAS_TIME else 0

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = n_start if CAUSAL else 0  # causal: only queries i >= j see key j
    for m_start in range(lo, q_len, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < q_len
        q_rows = q_begin + offs_m
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + q_rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
        lse = tl.load(LSE + q_rows * num_heads + h, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + q_rows * num_heads + h, mask=row_ok, other=0.0)
        ts_q = tl.load(ts + q_rows, mask=row_ok, other=0) if HAS_TIME else 0

        s_t = _dot(k, tl.trans(q), PRECISION, UPCAST) * sm_scale  # (keys, queries)
        s_t = _score_bias(s_t, offs_m[None, :] - offs_n[:, None], ts_k, ts_q, h, pos_bias, stride_pos_h,
                          max_rel, time_bias, stride_time_h, num_time_buckets, HAS_POS, HAS_TIME)
        valid = col_ok[:, None] & row_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
        p_t = tl.where(valid, tl.exp(s_t - lse[None, :]), 0.0)
        dv += _dot(p_t.to(do.dtype), do, PRECISION, UPCAST)
        dp_t = _dot(v, tl.trans(do), PRECISION, UPCAST)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, PRECISION, UPCAST)

    tl.store(DK + kv_rows[:, None] * stride_dkt + h * stride_dkh + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_rows[:, None] * stride_dvt + h * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA,
    q_offsets, kv_offsets, sched_seq, sched_start,
    pos_bias, time_bias, ts, DPOS, DTIME,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh,
    stride_pos_h, stride_time_h, max_rel, num_time_buckets,
    num_heads, head_dim, sm_scale,
    CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
    POS_GRAD: tl.constexpr, TIME_GRAD: tl.constexpr, POS_BINS: tl.constexpr, TIME_BINS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program per (query block, head): dQ, plus this block's share of the bias-table gradients."""
    pid = tl.program_id(0)
    h = pid % num_heads
    blk = pid // num_heads
    seq = tl.load(sched_seq + blk)
    m_start = tl.load(sched_start + blk)
    q_begin = tl.load(q_offsets + seq)
    q_len = (tl.load(q_offsets + seq + 1) - q_begin).to(tl.int32)
    kv_begin = tl.load(kv_offsets + seq)
    kv_len = (tl.load(kv_offsets + seq + 1) - kv_begin).to(tl.int32)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < head_dim
    q_rows = q_begin + offs_m
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + q_rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + q_rows * num_heads + h, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + q_rows * num_heads + h, mask=row_ok, other=0.0)
    ts_q = tl.load(ts + q_rows, mask=row_ok, other=0) if HAS_TIME else 0

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dpos = tl.zeros([POS_BINS], tl.float32)
    dtime = tl.zeros([TIME_BINS], tl.float32)
    hi = tl.minimum(kv_len, m_start + BLOCK_M) if CAUSAL else kv_len
    for n_start in range(0, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < kv_len
        kv_rows = kv_begin + offs_n
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        ts_k = tl.load(ts + kv_rows, mask=col_ok, other=0) if HAS_TIME else 0
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * sm_scale
        s = _score_bias(s, offs_m[:, None] - offs_n[None, :], ts_q, ts_k, h, pos_bias, stride_pos_h, max_rel,
                        time_bias, stride_time_h, num_time_buckets, HAS_POS, HAS_TIME)
        valid = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST)
        if POS_GRAD:
            dpos = _add_by_bucket(dpos, _pos_bucket(offs_m[:, None] - offs_n[None, :], max_rel), ds, valid, POS_BINS)
        if TIME_GRAD:
            dtime = _add_by_bucket(dtime, _time_bucket(ts_q, ts_k, num_time_buckets), ds, valid, TIME_BINS)

    tl.store(DQ + q_rows[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)
    if POS_GRAD:
        bins = tl.arange(0, POS_BINS)
        tl.atomic_add(DPOS + h * (2 * max_rel + 1) + bins, dpos, mask=bins < 2 * max_rel + 1)
    if TIME_GRAD:
        bins = tl.arange(0, TIME_BINS)
        tl.atomic_add(DTIME + h * num_time_buckets + bins, dtime, mask=bins < num_time_buckets)


# fmt: on


# ----------------------------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch settings of one kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _configs(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, BlockConfig]:
    """Tiles per kernel. Chosen by compiling for sm_90 (ptxas resource usage; see the compile tests): 8 warps
    keep the score tile plus the in-kernel bias math in registers (4 warps spill), and fp32 tiles are halved
    so that the pipelined K/V buffers fit Hopper's 227 KB of shared memory.
    """
    if device.type != "cuda":  # the interpreter: smallest legal tiles keep it fast
        small = BlockConfig(16, 16, 1, 1)
        return {"fwd": small, "dkdv": small, "dq": small}
    if dtype == torch.float32:
        return {
            "fwd": BlockConfig(64, 32, 4, 2),
            "dkdv": BlockConfig(32, 32, 4, 2),
            "dq": BlockConfig(32, 32, 4, 2),
        }
    return {
        "fwd": BlockConfig(128, 64, 8, 3 if head_dim <= 64 else 2),
        "dkdv": BlockConfig(64, 64, 8, 2),
        "dq": BlockConfig(64, 64, 8, 2),
    }


def _schedule(
    lengths: torch.Tensor,
    block: int,
    work: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
):
    """Flattened list of (sequence, local start) blocks covering every sequence, heaviest first.

    ``work`` gives each block's cost (defaults to equal); sorting heaviest-first shortens the tail when
    lengths are skewed. Returns (seq int32, start int32, count) with one host sync for the count.
    """
    n_blocks = (lengths + block - 1) // block
    count = int(n_blocks.sum())
    if count == 0:
        return None, None, 0
    seq = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), n_blocks, output_size=count
    )
    first = torch.cumsum(n_blocks, 0) - n_blocks
    start = (torch.arange(count, device=lengths.device) - first[seq]) * block
    if work is not None:
        order = torch.argsort(work(seq, start), descending=True, stable=True)
        seq, start = seq[order], start[order]
    return seq.to(torch.int32).contiguous(), start.to(torch.int32).contiguous(), count


def _keys_scanned(kv_lens: torch.Tensor, block_m: int, causal: bool):
    def work(seq: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return torch.minimum(kv_lens[seq], start + block_m) if causal else kv_lens[seq]

    return work


def _queries_scanned(q_lens: torch.Tensor, causal: bool):
    def work(seq: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return q_lens[seq] - start if causal else q_lens[seq]

    return work


def _precision(dtype: torch.dtype) -> tuple[str, bool]:
    """(tl.dot input precision, upcast half tiles to fp32): fp32 stays IEEE-exact for tight comparisons."""
    return ("ieee" if dtype == torch.float32 else "tf32"), (_interpreting() and dtype == torch.bfloat16)


def _check_backend(q: torch.Tensor) -> None:
    """What this backend adds to the shared checks (``models.attention.validate``): device, dtype, head size."""
    if not _interpreting() and q.device.type != "cuda":
        raise ValueError(
            "the triton attention backend needs CUDA tensors (set TRITON_INTERPRET=1 before importing triton "
            f"to interpret the kernels on a CPU); got tensors on {q.device}"
        )
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; the triton backend supports {_SUPPORTED_DTYPES}")
    if q.shape[2] > _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {q.shape[2]} is above the supported maximum of {_MAX_HEAD_DIM}")


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any row/head strides (e.g. q, k, v split from one qkv projection) but unit d-stride."""
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass
class _Bias:
    """Relative-bias inputs of self-attention, validated; dummies stand in for absent tables."""

    pos: torch.Tensor | None
    time: torch.Tensor | None
    ts: torch.Tensor | None

    @property
    def max_rel(self) -> int:
        return (self.pos.shape[1] - 1) // 2 if self.pos is not None else 0

    @property
    def num_time_buckets(self) -> int:
        return self.time.shape[1] if self.time is not None else 1

    def args(self, dummy: torch.Tensor) -> tuple:
        pos = self.pos if self.pos is not None else dummy
        time = self.time if self.time is not None else dummy
        ts = self.ts if self.ts is not None else dummy
        return (
            pos,
            time,
            ts,
            pos.stride(0) if self.pos is not None else 0,
            time.stride(0) if self.time is not None else 0,
            self.max_rel,
            self.num_time_buckets,
        )


def _bias_inputs(pos_bias, time_bias, timestamps) -> _Bias:
    """The (already validated) bias inputs, contiguous, timestamps in a type wide enough to difference."""
    ts = None
    if time_bias is not None:
        if timestamps.dtype in (torch.int64, torch.float32, torch.float64):
            ts = timestamps.contiguous()
        else:  # narrow types: difference them in a wide type so that nothing overflows
            ts = timestamps.to(torch.float64 if timestamps.is_floating_point() else torch.int64).contiguous()
    return _Bias(
        pos=pos_bias.contiguous() if pos_bias is not None else None,
        time=time_bias.contiguous() if time_bias is not None else None,
        ts=ts,
    )


def _forward(q, k, v, q_offsets, kv_offsets, causal: bool, bias: _Bias, keep_fp32_out: bool):
    """(out, lse, out32): out32 is an fp32 copy of out when asked for and out is not fp32 already."""
    total_q, heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.zeros((total_q, heads), dtype=torch.float32, device=q.device)
    store_out32 = keep_fp32_out and q.dtype != torch.float32
    out32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if store_out32 else out
    cfg = _configs(head_dim, q.dtype, q.device)["fwd"]
    q_lens = q_offsets[1:] - q_offsets[:-1]
    kv_lens = kv_offsets[1:] - kv_offsets[:-1]
    seq, start, count = _schedule(q_lens, cfg.block_m, _keys_scanned(kv_lens, cfg.block_m, causal))
    if count == 0:
        return out, lse, out32
    precision, upcast = _precision(q.dtype)
    _fwd_kernel[(count * heads,)](
        q,
        k,
        v,
        out,
        out32,
        lse,
        q_offsets,
        kv_offsets,
        seq,
        start,
        *bias.args(lse)[:3],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        *bias.args(lse)[3:],
        heads,
        head_dim,
        1.0 / math.sqrt(head_dim),
        CAUSAL=causal,
        HAS_POS=bias.pos is not None,
        HAS_TIME=bias.time is not None,
        STORE_OUT32=store_out32,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION=precision,
        UPCAST=upcast,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, lse, out32


def _backward(
    do, q, k, v, out, lse, q_offsets, kv_offsets, causal: bool, bias: _Bias, pos_grad: bool, time_grad: bool
):
    total_q, heads, head_dim = q.shape
    do = _rows_contiguous(do)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    dpos = torch.zeros(bias.pos.shape, dtype=torch.float32, device=q.device) if pos_grad else None
    dtime = torch.zeros(bias.time.shape, dtype=torch.float32, device=q.device) if time_grad else None
    if total_q == 0 or k.shape[0] == 0:
        return dq.zero_(), dk, dv, dpos, dtime
    delta = (do.float() * out.float()).sum(-1).contiguous()  # (total_q, H): rowsum(dO * O)
    cfgs = _configs(head_dim, q.dtype, q.device)
    q_lens = q_offsets[1:] - q_offsets[:-1]
    kv_lens = kv_offsets[1:] - kv_offsets[:-1]
    precision, upcast = _precision(q.dtype)
    block_d = max(16, triton.next_power_of_2(head_dim))
    common = dict(
        CAUSAL=causal,
        HAS_POS=bias.pos is not None,
        HAS_TIME=bias.time is not None,
        BLOCK_D=block_d,
        PRECISION=precision,
        UPCAST=upcast,
    )
    bias_args = bias.args(lse)
    qkv_strides = (
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        do.stride(0),
        do.stride(1),
    )
    scale = 1.0 / math.sqrt(head_dim)

    cfg = cfgs["dkdv"]
    seq, start, count = _schedule(kv_lens, cfg.block_n, _queries_scanned(q_lens, causal))
    if count:
        _bwd_dkdv_kernel[(count * heads,)](
            q,
            k,
            v,
            do,
            dk,
            dv,
            lse,
            delta,
            q_offsets,
            kv_offsets,
            seq,
            start,
            *bias_args[:3],
            *qkv_strides,
            dk.stride(0),
            dk.stride(1),
            dv.stride(0),
            dv.stride(1),
            *bias_args[3:],
            heads,
            head_dim,
            scale,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **common,
        )

    cfg = cfgs["dq"]
    seq, start, count = _schedule(q_lens, cfg.block_m, _keys_scanned(kv_lens, cfg.block_m, causal))
    if count:
        _bwd_dq_kernel[(count * heads,)](
            q,
            k,
            v,
            do,
            dq,
            lse,
            delta,
            q_offsets,
            kv_offsets,
            seq,
            start,
            *bias_args[:3],
            dpos if pos_grad else lse,
            dtime if time_grad else lse,
            *qkv_strides,
            dq.stride(0),
            dq.stride(1),
            *bias_args[3:],
            heads,
            head_dim,
            scale,
            POS_GRAD=pos_grad,
            TIME_GRAD=time_grad,
            POS_BINS=triton.next_power_of_2(2 * bias.max_rel + 1),
            TIME_BINS=triton.next_power_of_2(bias.num_time_buckets),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **common,
        )
    else:
        dq.zero_()
    return dq, dk, dv, dpos, dtime


class _JaggedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, causal, pos_bias, time_bias, ts):
        bias = _Bias(pos_bias, time_bias, ts)
        # The bias-table gradients are sums of dS = P * (dP - delta) over many entries, and each row of dS sums
        # to zero: delta = rowsum(dO * O) taken from a bf16-rounded O leaves a bias that those sums pile up.
        # So when a table needs its gradient, backward gets delta from an fp32 copy of O.
        exact_delta = any(t is not None and t.requires_grad for t in (pos_bias, time_bias))
        if q.shape[0] == 0 or k.shape[0] == 0:  # nothing to attend: zeros, like the reference
            out = torch.zeros_like(q, memory_format=torch.contiguous_format)
            lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
            out_for_delta = out
        else:
            out, lse, out_for_delta = _forward(q, k, v, q_offsets, kv_offsets, causal, bias, exact_delta)
        ctx.save_for_backward(q, k, v, out_for_delta, lse, q_offsets, kv_offsets, pos_bias, time_bias, ts)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, q_offsets, kv_offsets, pos_bias, time_bias, ts = ctx.saved_tensors
        bias = _Bias(pos_bias, time_bias, ts)
        pos_grad = pos_bias is not None and ctx.needs_input_grad[6]
        time_grad = time_bias is not None and ctx.needs_input_grad[7]
        dq, dk, dv, dpos, dtime = _backward(
            do, q, k, v, out, lse, q_offsets, kv_offsets, ctx.causal, bias, pos_grad, time_grad
        )
        return (
            dq,
            dk,
            dv,
            None,
            None,
            None,
            dpos.to(pos_bias.dtype) if pos_grad else None,
            dtime.to(time_bias.dtype) if time_grad else None,
            None,
        )


def jagged_self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    causal: bool = False,
    pos_bias: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention within each jagged sequence. q, k, v: (total, H, D); timestamps: (total,) seconds."""
    validate.check_self_attention(q, k, v, offsets, pos_bias, time_bias, timestamps)
    _check_backend(q)
    offsets = offsets.to(torch.int64).contiguous()
    bias = _bias_inputs(pos_bias, time_bias, timestamps)
    q, k, v = (_rows_contiguous(t) for t in (q, k, v))
    return _JaggedAttention.apply(q, k, v, offsets, offsets, bool(causal), bias.pos, bias.time, bias.ts)


def jagged_cross_attention(
    q: torch.Tensor,
    q_offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
) -> torch.Tensor:
    """Each sequence's queries attend over that sequence's keys. q: (total_q, H, D); k, v: (total_kv, H, D)."""
    validate.check_cross_attention(q, q_offsets, k, v, kv_offsets)
    _check_backend(q)
    q_offsets, kv_offsets = (o.to(torch.int64).contiguous() for o in (q_offsets, kv_offsets))
    q, k, v = (_rows_contiguous(t) for t in (q, k, v))
    return _JaggedAttention.apply(q, k, v, q_offsets, kv_offsets, False, None, None, None)
