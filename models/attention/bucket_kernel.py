"""fp32 attention over padded length buckets with a hand-written backward: the jagged CPU path's training kernel.

``models.attention.jagged`` lays a batch out in length buckets (dense (n, L) blocks). Per bucket this module
computes, in fp32 whatever the input dtype,

    S = scale * Q K^T + B,   P = softmax(S),   O = P V

(B: the gathered relative bias with its -inf column for masked cells, or an additive -inf mask for causality /
key padding, or nothing) and its backward

    dV = P^T dO,   dS = P * (dO V^T - rowsum(P * dO V^T)),   dQ = scale * dS K,   dK = scale * dS^T Q,

with dS also the gradient of every bias cell, summed into the bias table in fp32. That is the arithmetic of
PyTorch's math SDPA kernel on CPU (which upcasts bf16 to fp32 too), without its per-call small ops: one gather
of the packed rows (q, k, v of a row sit together: one ``index_select`` per bucket instead of one per tensor,
and no zero-filled buffer), one copy into fp32 heads-first blocks, no ``contiguous`` / scale / mask-check
copies, the bias added inside the score GEMM (``baddbmm``), and for the bias table one ``index_add_`` of the
fp32 dS (the math kernel rounds dS to the mask's bf16 before the table sums it).

Padded slots repeat a real row of their sequence instead of holding zeros: no real query ever gives them
weight (padding sits at the end of each sequence, so causal buckets never reach it, and other buckets mask
padded keys), their own outputs are dropped, and the saved attention rows of padded queries are zeroed, so
they add nothing to any gradient; they change nothing and cost no fill of the inputs.

Moves between jagged rows and the blocks are D-wide row gathers into one buffer for all buckets
(``HeadsFirst``), so a call allocates a few large buffers, not a few per bucket: the distributed trainer keeps
freed memory in the process (``gemflow.malloc``), which makes re-allocating them each step free.

Every bucket's saved state (fp32 Q, K, V and P) is what the math kernel's autograd keeps as well.

A bucket (``models.attention.jagged_layout.Bucket``) gives: ``slot_rows`` (n * L,) int64, the source row of every slot
(a padded slot repeats its sequence's last row); ``valid`` (n, L) bool; ``padded``; ``start``, its first slot in
the buffer of all buckets; ``n`` and ``max_len``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None,
    heads: int,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, Lq, D), (b, Lk, D), (b, Lk, D) fp32, b = n * heads -> O (b, Lq, D) (into ``out`` if given), P (b, Lq, Lk).

    ``bias``: None, (b, Lq, Lk), or anything broadcastable to (n, heads, Lq, Lk) (added after the GEMM).
    """
    b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    if bias is not None and bias.shape == (b, lq, lk):
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
    else:
        scores = torch.baddbmm(q.new_empty(()).expand(b, lq, lk), q, k.transpose(1, 2), beta=0.0, alpha=scale)
        if bias is not None:
            scores.view(b // heads, heads, lq, lk).add_(bias)
    probs = torch.softmax(scores, -1)
    return torch.bmm(probs, v, out=out), probs


def block_backward(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    probs: torch.Tensor,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> torch.Tensor:
    """Gradients of ``block_forward`` written into ``dq``, ``dk``, ``dv`` (fp32, the inputs' shapes); returns
    dS (b, Lq, Lk), the gradient of every score cell (= of every bias cell)."""
    torch.bmm(probs.transpose(1, 2), d_out, out=dv)
    ds = torch.bmm(d_out, v.transpose(1, 2)).mul_(probs)  # P * dP
    ds.addcmul_(probs, ds.sum(-1, keepdim=True), value=-1.0)  # P * (dP - rowsum(P * dP))
    torch.baddbmm(dq, ds, k, beta=0.0, alpha=scale, out=dq)
    torch.baddbmm(dk, ds.transpose(1, 2), q, beta=0.0, alpha=scale, out=dk)
    return ds


@dataclass(frozen=True)
class HeadsFirst:
    """Index maps between jagged rows (total, parts, H, D) and one buffer of every bucket's heads-first blocks.

    The buffer holds, bucket after bucket, (parts, n, H, L, D) blocks, as rows of D (``starts[i]``: bucket i's
    first row; q/k/v of one bucket are then contiguous (n * H, L, D) GEMM operands). Both moves are one
    ``index_select`` of D-wide rows: ``gather`` (buffer row -> source row of the (total * parts * H, D) view; a
    padded slot reads its repeated row) and ``scatter`` (source row -> buffer row; rows no bucket covers read
    the buffer's extra last row, kept zero).
    """

    gather: torch.Tensor
    scatter: torch.Tensor
    starts: list[int]
    rows: int  # buffer rows, without the extra zero row


def heads_first(buckets, parts: int, heads: int, total: int) -> HeadsFirst:
    """The ``HeadsFirst`` maps of ``buckets`` over a jagged tensor of ``total`` rows (vectorized per bucket)."""
    gathers, starts, start = [], [], 0
    width = parts * heads
    device = buckets[0].slot_rows.device if buckets else torch.device("cpu")
    part_head = torch.arange(parts, device=device)[:, None] * heads + torch.arange(heads, device=device)
    scatter = torch.empty(total * width, dtype=torch.int64, device=device)
    covered = torch.zeros(total, dtype=torch.bool, device=device)
    for bucket in buckets:
        n, length = bucket.n, bucket.max_len
        slot_rows = bucket.slot_rows.view(1, n, 1, length)
        gather = (slot_rows * width + part_head.view(parts, 1, heads, 1)).flatten()  # (parts, n, H, L)
        real = bucket.valid.view(1, n, 1, length).expand(parts, n, heads, length).flatten()
        scatter[gather[real]] = torch.arange(start, start + gather.numel(), device=device)[real]
        covered[bucket.slot_rows[bucket.valid.flatten()]] = True
        gathers.append(gather)
        starts.append(start)
        start += gather.numel()
    scatter.view(total, width).masked_fill_(~covered[:, None], start)  # the zero row
    gather = torch.cat(gathers) if gathers else scatter.new_zeros(0)
    return HeadsFirst(gather, scatter, starts, start)


def _to_buffer(src: torch.Tensor, moves: HeadsFirst) -> torch.Tensor:
    """Jagged (total, parts, H, D) or (total, H, D) -> the fp32 buffer (rows, D): one gather, one cast."""
    return src.reshape(-1, src.shape[-1]).index_select(0, moves.gather).float()


def _from_buffer(buffer: torch.Tensor, moves: HeadsFirst, like_shape, dtype) -> torch.Tensor:
    """The fp32 buffer (rows + 1, D), last row zero -> jagged ``like_shape`` in ``dtype``: one cast, one gather."""
    return buffer.to(dtype).index_select(0, moves.scatter).view(like_shape)


def _blocks(buffer: torch.Tensor, start: int, parts: int, n: int, heads: int, length: int) -> torch.Tensor:
    """One bucket's (parts, n * H, L, D) view of a buffer."""
    size = parts * n * heads * length
    return buffer[start : start + size].view(parts, n * heads, length, buffer.shape[-1])


def _drop_padded_queries(probs: torch.Tensor, bucket, heads: int) -> torch.Tensor:
    """Zero the attention rows of padded query slots (their outputs are dropped, their output gradient is the
    repeated row's): with P = 0 there, they add nothing to dV, dS (hence dK, dQ and the bias gradient). Done
    on the saved P, (L, Lk) per row, not on dO, (L, D), in every backward."""
    if bucket.padded:
        probs.view(bucket.n, heads, bucket.max_len, -1).masked_fill_(~bucket.valid[:, None, :, None], 0.0)
    return probs


def _no_autocast(like: torch.Tensor):
    """The kernel's arithmetic is fp32 by design: an enclosing autocast must not turn its GEMMs into bf16."""
    return torch.autocast(like.device.type, enabled=False)


class SelfBuckets(torch.autograd.Function):
    """Self-attention over every bucket of one batch: packed (total, 3, H, D) q/k/v rows -> (total, H, D).

    ``qkv_moves`` / ``out_moves``: ``heads_first`` maps of the buckets for 3 parts and for 1. ``masks[i]``: the
    bucket's additive fp32 mask (broadcastable to (n, H, L, L)) or None; ``bias_index[i]``: None or the bucket's
    (n or 1, H, L, L) int32 index into the flat fp32 ``table`` (which then also masks).
    """

    @staticmethod
    def forward(ctx, qkv, table, buckets, qkv_moves, out_moves, masks, bias_index):
        with _no_autocast(qkv):
            return SelfBuckets._forward(ctx, qkv, table, buckets, qkv_moves, out_moves, masks, bias_index)

    @staticmethod
    def backward(ctx, grad):
        with _no_autocast(grad):
            return SelfBuckets._backward(ctx, grad)

    @staticmethod
    def _forward(ctx, qkv, table, buckets, qkv_moves, out_moves, masks, bias_index):
        total, _, heads, dim = qkv.shape
        scale = 1.0 / math.sqrt(dim)
        x = _to_buffer(qkv, qkv_moves)
        out = x.new_empty((out_moves.rows + 1, dim))
        out[-1].zero_()
        probs = []
        for bucket, mask, index, start, out_start in zip(
            buckets, masks, bias_index, qkv_moves.starts, out_moves.starts, strict=True
        ):
            n, length = bucket.n, bucket.max_len
            q, k, v = _blocks(x, start, 3, n, heads, length)
            bias = mask
            if index is not None:
                bias = table.index_select(0, index.flatten()).view(index.shape)
                if index.shape[0] == n:
                    bias = bias.view(n * heads, length, length)
            o = _blocks(out, out_start, 1, n, heads, length)[0]
            probs.append(
                _drop_padded_queries(block_forward(q, k, v, scale, bias, heads, out=o)[1], bucket, heads)
            )
        ctx.save_for_backward(x, *probs)
        ctx.meta = (
            buckets,
            bias_index,
            qkv_moves,
            out_moves,
            qkv.shape,
            scale,
            table.shape[0] if table is not None else 0,
        )
        return _from_buffer(out, out_moves, (total, heads, dim), qkv.dtype)

    @staticmethod
    def _backward(ctx, grad):
        x, *probs = ctx.saved_tensors
        buckets, bias_index, qkv_moves, out_moves, shape, scale, table_size = ctx.meta
        heads = shape[2]
        d_out = _to_buffer(grad, out_moves)
        dx = x.new_empty((qkv_moves.rows + 1, x.shape[1]))
        dx[-1].zero_()
        grad_table = None
        if table_size and ctx.needs_input_grad[1]:
            grad_table = torch.zeros(table_size, dtype=torch.float32, device=grad.device)
        for bucket, index, p, start, out_start in zip(
            buckets, bias_index, probs, qkv_moves.starts, out_moves.starts, strict=True
        ):
            n, length = bucket.n, bucket.max_len
            do = _blocks(d_out, out_start, 1, n, heads, length)[0]
            q, k, v = _blocks(x, start, 3, n, heads, length)
            ds = block_backward(do, q, k, v, p, scale, *_blocks(dx, start, 3, n, heads, length))
            if grad_table is not None and index is not None:
                if index.shape[0] != n:  # one index for all sequences: sum their cells first (dense)
                    ds = ds.view(n, -1).sum(0)
                grad_table.index_add_(0, index.flatten(), ds.flatten())
        return _from_buffer(dx, qkv_moves, shape, grad.dtype), grad_table, None, None, None, None, None


class CrossBuckets(torch.autograd.Function):
    """Cross-attention over matching query and key buckets: q (total_q, H, D), packed kv (total_kv, 2, H, D).

    ``q_moves`` (1 part) / ``kv_moves`` (2 parts): ``heads_first`` maps of the query and key buckets. A query
    whose sequence has no keys gets 0; so does the gradient of keys nobody queries.
    """

    @staticmethod
    def forward(ctx, q, kv, q_buckets, kv_buckets, q_moves, kv_moves, masks):
        with _no_autocast(q):
            return CrossBuckets._forward(ctx, q, kv, q_buckets, kv_buckets, q_moves, kv_moves, masks)

    @staticmethod
    def backward(ctx, grad):
        with _no_autocast(grad):
            return CrossBuckets._backward(ctx, grad)

    @staticmethod
    def _forward(ctx, q, kv, q_buckets, kv_buckets, q_moves, kv_moves, masks):
        heads, dim = q.shape[1], q.shape[2]
        scale = 1.0 / math.sqrt(dim)
        qx, kvx = _to_buffer(q, q_moves), _to_buffer(kv, kv_moves)
        out = qx.new_empty((q_moves.rows + 1, dim))
        out[-1].zero_()
        probs = []
        for qb, kb, mask, q_start, kv_start in zip(
            q_buckets, kv_buckets, masks, q_moves.starts, kv_moves.starts, strict=True
        ):
            (qh,) = _blocks(qx, q_start, 1, qb.n, heads, qb.max_len)
            k, v = _blocks(kvx, kv_start, 2, kb.n, heads, kb.max_len)
            o = _blocks(out, q_start, 1, qb.n, heads, qb.max_len)[0]
            probs.append(
                _drop_padded_queries(block_forward(qh, k, v, scale, mask, heads, out=o)[1], qb, heads)
            )
        ctx.save_for_backward(qx, kvx, *probs)
        ctx.meta = (q_buckets, kv_buckets, q_moves, kv_moves, scale, kv.shape)
        return _from_buffer(out, q_moves, q.shape, q.dtype)

    @staticmethod
    def _backward(ctx, grad):
        qx, kvx, *probs = ctx.saved_tensors
        q_buckets, kv_buckets, q_moves, kv_moves, scale, kv_shape = ctx.meta
        heads = grad.shape[1]
        d_out = _to_buffer(grad, q_moves)
        dq = qx.new_empty((q_moves.rows + 1, qx.shape[1]))
        dkv = kvx.new_empty((kv_moves.rows + 1, kvx.shape[1]))
        dq[-1].zero_()
        dkv[-1].zero_()
        for qb, kb, p, q_start, kv_start in zip(
            q_buckets, kv_buckets, probs, q_moves.starts, kv_moves.starts, strict=True
        ):
            (do,) = _blocks(d_out, q_start, 1, qb.n, heads, qb.max_len)
            (qh,) = _blocks(qx, q_start, 1, qb.n, heads, qb.max_len)
            k, v = _blocks(kvx, kv_start, 2, kb.n, heads, kb.max_len)
            (dqh,) = _blocks(dq, q_start, 1, qb.n, heads, qb.max_len)
            dk, dv = _blocks(dkv, kv_start, 2, kb.n, heads, kb.max_len)
            block_backward(do, qh, k, v, p, scale, dqh, dk, dv)
        return (
            _from_buffer(dq, q_moves, grad.shape, grad.dtype),
            _from_buffer(dkv, kv_moves, kv_shape, grad.dtype),
            None,
            None,
            None,
            None,
            None,
        )
