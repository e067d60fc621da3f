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
padded keys), their own outputs are dropped, and the gradient of a padded query row is zeroed before the
backward, so they change nothing and cost no fill.

Every bucket's saved state (fp32 Q, K, V and P) is what the math kernel's autograd keeps as well.

A bucket (``models.attention.jagged.Bucket``) gives: ``slot_rows`` (n * L,) int64, the source row of every slot
(a padded slot repeats its sequence's last row); ``valid`` (n, L) bool; ``padded``; ``start``, its first slot in
the buffer of all buckets; ``n`` and ``max_len``.
"""

from __future__ import annotations

import math

import torch


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, Lq, D), (b, Lk, D), (b, Lk, D) fp32, b = n * heads -> O (b, Lq, D), P (b, Lq, Lk).

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
    return torch.bmm(probs, v), probs


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


def _heads_first(rows: torch.Tensor, n: int, length: int, parts: int) -> torch.Tensor:
    """(n * L, parts, H, D) any dtype -> (parts, n * H, L, D) fp32 contiguous, in one copy."""
    _, _, heads, dim = rows.shape
    out = torch.empty((parts, n, heads, length, dim), dtype=torch.float32, device=rows.device)
    out.copy_(rows.reshape(n, length, parts, heads, dim).permute(2, 0, 3, 1, 4))
    return out.view(parts, n * heads, length, dim)


def _rows_first(blocks: torch.Tensor, out: torch.Tensor, n: int, length: int) -> None:
    """(parts, n * H, L, D) fp32 -> ``out`` (n * L, parts, H, D) (its dtype), in one copy."""
    parts, _, _, dim = blocks.shape
    heads = out.shape[2]
    out.view(n, length, parts, heads, dim).permute(2, 0, 3, 1, 4).copy_(
        blocks.view(parts, n, heads, length, dim)
    )


def _gather(src: torch.Tensor, bucket, identity: bool) -> torch.Tensor:
    """One bucket's slots of ``src``; ``identity``: the buffer of all buckets is ``src`` itself (no padding, rows
    in order), so the bucket is a slice."""
    if identity:
        return src.narrow(0, bucket.start, bucket.n * bucket.max_len)
    return src.index_select(0, bucket.slot_rows)


def _d_out_block(grad: torch.Tensor, bucket, identity: bool) -> torch.Tensor:
    """The output gradient of one query bucket, (n * H, L, D) fp32, zero on padded query rows."""
    d_out = _heads_first(_gather(grad, bucket, identity).unsqueeze(1), bucket.n, bucket.max_len, 1)[0]
    if bucket.padded:
        heads = grad.shape[1]
        d_out.view(bucket.n, heads, bucket.max_len, -1).masked_fill_(~bucket.valid[:, None, :, None], 0.0)
    return d_out


class SelfBuckets(torch.autograd.Function):
    """Self-attention over every bucket of one batch: packed (total, 3, H, D) q/k/v rows -> (total, H, D).

    ``masks[i]``: the bucket's additive fp32 mask (broadcastable to (n, H, L, L)) or None; ``bias_index[i]``:
    None or the bucket's (n or 1, H, L, L) int32 index into the flat fp32 ``table`` (which then also masks).
    ``slot_of_row`` (total,): each row's slot in the buffer of all buckets (every row has one).
    """

    @staticmethod
    def forward(ctx, qkv, table, buckets, slot_of_row, num_slots, masks, bias_index, identity):
        heads, dim = qkv.shape[2], qkv.shape[3]
        scale = 1.0 / math.sqrt(dim)
        out = qkv.new_empty((num_slots, heads, dim))
        saved = []
        for bucket, mask, index in zip(buckets, masks, bias_index, strict=True):
            n, length = bucket.n, bucket.max_len
            x = _heads_first(_gather(qkv, bucket, identity), n, length, 3)
            bias = mask
            if index is not None:
                bias = table.index_select(0, index.flatten()).view(index.shape)
                if index.shape[0] == n:
                    bias = bias.view(n * heads, length, length)
            o, p = block_forward(x[0], x[1], x[2], scale, bias, heads)
            _rows_first(o[None], out[bucket.start : bucket.start + n * length].unsqueeze(1), n, length)
            saved += [x, p]
        ctx.save_for_backward(slot_of_row, *saved)
        ctx.meta = (
            buckets,
            bias_index,
            identity,
            qkv.shape,
            scale,
            table.shape[0] if table is not None else 0,
        )
        return out if identity else out.index_select(0, slot_of_row)

    @staticmethod
    def backward(ctx, grad):
        slot_of_row, *saved = ctx.saved_tensors
        buckets, bias_index, identity, shape, scale, table_size = ctx.meta
        grad_rows = grad.new_empty((sum(b.n * b.max_len for b in buckets), *shape[1:]))
        grad_table = None
        if table_size and ctx.needs_input_grad[1]:
            grad_table = torch.zeros(table_size, dtype=torch.float32, device=grad.device)
        for i, (bucket, index) in enumerate(zip(buckets, bias_index, strict=True)):
            x, p = saved[2 * i], saved[2 * i + 1]
            n, length = bucket.n, bucket.max_len
            dx = torch.empty_like(x)
            ds = block_backward(_d_out_block(grad, bucket, identity), x[0], x[1], x[2], p, scale, *dx)
            if grad_table is not None and index is not None:
                if index.shape[0] != n:  # one index for all sequences: sum their cells first (dense)
                    ds = ds.view(n, -1).sum(0)
                grad_table.index_add_(0, index.flatten(), ds.flatten())
            _rows_first(dx, grad_rows[bucket.start : bucket.start + n * length], n, length)
        grad_qkv = grad_rows if identity else grad_rows.index_select(0, slot_of_row)
        return grad_qkv, grad_table, None, None, None, None, None, None


class CrossBuckets(torch.autograd.Function):
    """Cross-attention over matching query and key buckets: q (total_q, H, D), packed kv (total_kv, 2, H, D).

    ``q_slot_of_row`` / ``kv_slot_of_row``: each row's slot, or the buffers' extra last slot (zeros) for a row no
    bucket covers (a query whose sequence has no keys gets 0; so does the gradient of keys nobody queries).
    """

    @staticmethod
    def forward(ctx, q, kv, q_buckets, kv_buckets, q_slot_of_row, kv_slot_of_row, masks):
        heads, dim = q.shape[1], q.shape[2]
        scale = 1.0 / math.sqrt(dim)
        out = q.new_empty((sum(b.n * b.max_len for b in q_buckets) + 1, heads, dim))
        out[-1].zero_()
        saved = []
        for qb, kb, mask in zip(q_buckets, kv_buckets, masks, strict=True):
            qx = _heads_first(q.index_select(0, qb.slot_rows).unsqueeze(1), qb.n, qb.max_len, 1)
            kvx = _heads_first(kv.index_select(0, kb.slot_rows), kb.n, kb.max_len, 2)
            o, p = block_forward(qx[0], kvx[0], kvx[1], scale, mask, heads)
            _rows_first(o[None], out[qb.start : qb.start + qb.n * qb.max_len].unsqueeze(1), qb.n, qb.max_len)
            saved += [qx, kvx, p]
        ctx.save_for_backward(q_slot_of_row, kv_slot_of_row, *saved)
        ctx.meta = (q_buckets, kv_buckets, scale, kv.shape)
        return out.index_select(0, q_slot_of_row)

    @staticmethod
    def backward(ctx, grad):
        q_slot_of_row, kv_slot_of_row, *saved = ctx.saved_tensors
        q_buckets, kv_buckets, scale, kv_shape = ctx.meta
        gq = grad.new_empty((sum(b.n * b.max_len for b in q_buckets) + 1, *grad.shape[1:]))
        gkv = grad.new_empty((sum(b.n * b.max_len for b in kv_buckets) + 1, *kv_shape[1:]))
        gq[-1].zero_()
        gkv[-1].zero_()
        for i, (qb, kb) in enumerate(zip(q_buckets, kv_buckets, strict=True)):
            qx, kvx, p = saved[3 * i : 3 * i + 3]
            dq, dkv = torch.empty_like(qx), torch.empty_like(kvx)
            block_backward(
                _d_out_block(grad, qb, False), qx[0], kvx[0], kvx[1], p, scale, dq[0], dkv[0], dkv[1]
            )
            _rows_first(dq, gq[qb.start : qb.start + qb.n * qb.max_len].unsqueeze(1), qb.n, qb.max_len)
            _rows_first(dkv, gkv[kb.start : kb.start + kb.n * kb.max_len], kb.n, kb.max_len)
        return (
            gq.index_select(0, q_slot_of_row),
            gkv.index_select(0, kv_slot_of_row),
            None,
            None,
            None,
            None,
            None,
        )
