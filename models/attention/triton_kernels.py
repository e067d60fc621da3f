"""Triton kernels of jagged attention: forward, and the two FlashAttention-2 backward kernels.

Same contract as ``models.attention.reference``: values (total, H, D) + offsets (B + 1,), never a padded copy.
The kernels read the offsets themselves and run flash-style (online softmax, fp32 accumulation):

- one program per (query block, head); the query blocks of all sequences form one flattened schedule
  (``models.attention.triton_launch``), heaviest first, so a batch of Zipf-distributed lengths wastes no
  program on padding;
- self-attention adds the relative position / time bias inside the kernel from the two small bias tables
  and the timestamps; its backward also returns the gradients of those tables;
- cross-attention is the same kernel with separate query and key offsets, no mask and no bias.

Backward is FlashAttention-2 style: ``delta = rowsum(dO * O)``, one kernel for dK/dV (program per key block,
looping over queries) and one for dQ (program per query block, looping over keys), which also accumulates the
bias-table gradients.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Finite "minus infinity": masked scores use it so that fully masked (padding) rows never produce NaNs.
_NEG = tl.constexpr(-1.0e30)

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
def fwd_kernel(
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
    if STORE_OUT32:  # contiguous (total, H, D) fp32 copy, see models.attention.triton._JaggedAttention
        tl.store(OUT32 + (q_rows[:, None] * num_heads + h) * head_dim + offs_d[None, :], out,
                 mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + q_rows * num_heads + h, lse, mask=row_ok)


@triton.jit
def bwd_dkdv_kernel(
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
def bwd_dq_kernel(
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
