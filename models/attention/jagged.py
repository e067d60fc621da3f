"""CPU fast path for jagged attention: length buckets, never paying for the batch's longest sequence.

Same ops and signatures as ``models.attention.reference`` (read its docstring for the layout, the relative
position / time bias and the empty-sequence semantics). How it avoids padding (the buckets and row moves are
``models.attention.jagged_layout``, the per-batch bias plan ``models.attention.jagged_plan``; here the ops):

1. ``plan_self`` / ``plan_cross`` group the non-empty sequences by length class (all lengths up to ``SHORT_LEN``
   share one class; above it, classes grow geometrically by ``1 + PAD_BUDGET``, so a class padded to its own
   longest sequence wastes at most ``PAD_BUDGET`` of its tokens), then merge neighbouring classes where one
   kernel call fewer saves more than the padding it adds (``merge_groups``). Indices come from the offsets in
   a few vectorized ops; Python loops run over classes and buckets (a few dozen), never over sequences.
2. Training (any input needs a gradient): ``models.attention.bucket_kernel`` runs every bucket of the call in
   one autograd node: per bucket one gather of the packed rows (``jagged_self_attention_packed`` takes the fused
   projection's (total, 3, H, D) view, so q, k and v move together; a padded slot repeats a real row instead
   of needing a zero-filled buffer), one copy into fp32 heads-first blocks, the score GEMM with the bias added
   inside it, softmax, the value GEMM, and a hand-written backward (the math SDPA kernel's arithmetic without
   its per-call copies and checks). The relative bias is built per bucket at (1 or n, H, L_b, L_b), never at
   (B, H, N_max, N_max), and cheaply: each cell's column in a small combined (position x time-gap) table,
   causality and key padding included, is computed once per batch (``SelfPlan``, reused by every layer and
   head), so a layer's whole bias is one gather from its (H, P * T + 1) table, and its gradient one fp32
   ``index_add_`` of the score gradients. Without tables the causal / key-padding masks are built once per
   batch too. Causal buckets need no key-padding mask: padding sits at the end of each sequence, so a real
   query never sees a padded key.
3. Forward only (inference, ``no_grad``): one copy moves the rows into a zero-padded buffer holding every
   bucket's dense (n, L_b, H, D) block (``_MoveRows``) and each bucket runs
   ``torch.nn.functional.scaled_dot_product_attention`` (the fused CPU kernel), the bias gathered in the
   inputs' dtype.
4. The real rows of every bucket go back to their jagged place with one more move; rows no bucket covers
   (cross-attention queries whose sequence has no keys) stay zero. As in the reference, a batch where nothing
   attends returns plain zeros.

Autograd runs through these ops (forward and backward). bf16 inputs are computed in fp32 inside the bucket
kernel (as the math SDPA kernel does) and returned in bf16; the bias-table gradients are summed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.attention import bucket_kernel, validate
from models.attention.jagged_layout import from_blocks, plan_cross, to_blocks
from models.attention.jagged_plan import SelfPlan, additive_mask, cached_plan_self_attention, combined_table


def _sdpa(qb, kb, vb, mask, is_causal: bool = False) -> torch.Tensor:
    """SDPA on (n, L, H, D) blocks (it wants heads first)."""
    out = F.scaled_dot_product_attention(
        qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), attn_mask=mask, is_causal=is_causal
    )
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------------------------- ops
def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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
    return _self_attention(
        q, k, v, None, offsets, causal=causal, pos_bias=pos_bias, time_bias=time_bias, timestamps=timestamps
    )


def jagged_self_attention_packed(
    qkv: torch.Tensor,
    offsets: torch.Tensor,
    *,
    causal: bool = False,
    pos_bias: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """``jagged_self_attention`` on q, k, v packed as (total, 3, H, D), the fused projection's layout: the
    buckets gather each row's q, k and v in one move (and scatter their gradients back in one)."""
    q, k, v = qkv.unbind(1)
    validate.check_self_attention(q, k, v, offsets, pos_bias, time_bias, timestamps)
    return _self_attention(
        q, k, v, qkv, offsets, causal=causal, pos_bias=pos_bias, time_bias=time_bias, timestamps=timestamps
    )


def _self_attention(q, k, v, qkv, offsets, *, causal, pos_bias, time_bias, timestamps) -> torch.Tensor:
    plan = cached_plan_self_attention(
        offsets,
        timestamps,
        causal=bool(causal),
        heads=q.shape[1],
        pos_columns=pos_bias.shape[1] if pos_bias is not None else 0,
        time_columns=time_bias.shape[1] if time_bias is not None else 0,
    )
    layout_ = plan.layout
    if not layout_.buckets:  # nothing attends
        return q.new_zeros(q.shape)
    tables = plan.pos_columns or plan.time_columns
    if not _needs_grad(q, k, v, pos_bias, time_bias):
        return _self_attention_sdpa(q, k, v, plan, bool(causal), pos_bias, time_bias)
    # the combined table in the inputs' dtype, as the mask SDPA would get, then fp32 for the kernel
    table = combined_table(pos_bias, time_bias, q.dtype).float() if tables else None
    qkv = torch.stack([q, k, v], 1) if qkv is None else qkv
    return bucket_kernel.SelfBuckets.apply(
        qkv, table, layout_.buckets, plan.qkv_moves, plan.out_moves, plan.masks, plan.bias_index
    )


def _self_attention_sdpa(q, k, v, plan: SelfPlan, causal: bool, pos_bias, time_bias) -> torch.Tensor:
    """Forward only (inference, no_grad): PyTorch's fused CPU kernel per bucket."""
    layout_ = plan.layout
    table = combined_table(pos_bias, time_bias, q.dtype) if plan.pos_columns or plan.time_columns else None
    outs = []
    for bucket, index, qb, kb, vb in zip(
        layout_.buckets,
        plan.bias_index,
        to_blocks(q, layout_),
        to_blocks(k, layout_),
        to_blocks(v, layout_),
        strict=True,
    ):
        if index is not None:  # causality and key padding are in the bias (its -inf column)
            outs.append(_sdpa(qb, kb, vb, table.index_select(0, index.flatten()).view(index.shape)))
        elif causal:
            outs.append(_sdpa(qb, kb, vb, None, is_causal=bucket.max_len > 1))
        else:
            outs.append(_sdpa(qb, kb, vb, bucket.valid[:, None, None, :] if bucket.padded else None))
    return from_blocks(outs, layout_, q)


def jagged_cross_attention(
    q: torch.Tensor,
    q_offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
) -> torch.Tensor:
    """Each sequence's queries attend over that sequence's keys. q: (total_q, H, D); k, v: (total_kv, H, D)."""
    validate.check_cross_attention(q, q_offsets, k, v, kv_offsets)
    return _cross_attention(q, q_offsets, k, v, None, kv_offsets)


def jagged_cross_attention_packed(
    q: torch.Tensor, q_offsets: torch.Tensor, kv: torch.Tensor, kv_offsets: torch.Tensor
) -> torch.Tensor:
    """``jagged_cross_attention`` with k, v packed as (total_kv, 2, H, D), the fused projection's layout."""
    k, v = kv.unbind(1)
    validate.check_cross_attention(q, q_offsets, k, v, kv_offsets)
    return _cross_attention(q, q_offsets, k, v, kv, kv_offsets)


def _cross_attention(q, q_offsets, k, v, kv, kv_offsets) -> torch.Tensor:
    q_plan, kv_plan = plan_cross(q_offsets, kv_offsets)
    if not q_plan.buckets:  # no sequence has both queries and keys
        return q.new_zeros(q.shape)
    if not _needs_grad(q, k, v):
        outs = []
        for kv_bucket, qb, kb, vb in zip(
            kv_plan.buckets, to_blocks(q, q_plan), to_blocks(k, kv_plan), to_blocks(v, kv_plan), strict=True
        ):
            outs.append(_sdpa(qb, kb, vb, kv_bucket.valid[:, None, None, :] if kv_bucket.padded else None))
        return from_blocks(outs, q_plan, q)
    kv = torch.stack([k, v], 1) if kv is None else kv
    masks = [additive_mask(b, causal=False) for b in kv_plan.buckets]
    heads = q.shape[1]
    q_moves = bucket_kernel.heads_first(q_plan.buckets, 1, heads, q.shape[0])
    kv_moves = bucket_kernel.heads_first(kv_plan.buckets, 2, heads, kv.shape[0])
    return bucket_kernel.CrossBuckets.apply(q, kv, q_plan.buckets, kv_plan.buckets, q_moves, kv_moves, masks)
