"""CPU fast path for jagged attention: length buckets + fused SDPA, never paying for the batch's longest sequence.

Same ops and signatures as ``models.attention.reference`` (read its docstring for the layout, the relative
position / time bias and the empty-sequence semantics). How it avoids padding:

1. ``plan_self`` / ``plan_cross`` group the non-empty sequences by length class (all lengths up to ``SHORT_LEN``
   share one class; above it, classes grow geometrically by ``1 + PAD_BUDGET``, so a class padded to its own
   longest sequence wastes at most ``PAD_BUDGET`` of its tokens), then merge neighbouring classes where one
   kernel call fewer saves more than the padding it adds (``merge_groups``). Indices come from the offsets in
   a few vectorized ops; Python loops run over classes and buckets (a few dozen), never over sequences.
2. One copy moves the rows into a zero-padded buffer holding every bucket's dense (n, L_b, H, D) block
   (``_MoveRows``: no row repeats, so its backward is the reverse copy, not a scatter-add).
3. Each bucket runs ``torch.nn.functional.scaled_dot_product_attention``: the fused CPU kernel when no bias needs
   a gradient, PyTorch's math kernel otherwise. The relative bias is built per bucket at (1 or n, H, L_b, L_b),
   never at (B, H, N_max, N_max). Causal buckets need no key-padding mask: padding sits at the end of each
   sequence, so a real query never sees a padded key.
4. The real rows of every bucket go back to their jagged place with one more move; rows no bucket covers
   (cross-attention queries whose sequence has no keys) stay zero. As in the reference, a batch where nothing
   attends returns plain zeros.

Autograd runs through these ops (forward and backward). bf16 inputs stay bf16 inside SDPA, whose CPU kernels
accumulate in fp32 (the math kernel upcasts); the bias-table gradients are summed in fp32 too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.attention.reference import pos_bucket, time_bucket

PAD_BUDGET = 0.125  # at most this fraction of a bucket's tokens is padding (above SHORT_LEN)
SHORT_LEN = 16  # sequences this short share one bucket: their padding costs less than another kernel call
# One more SDPA call (forward + backward, ~a dozen kernels) costs about as much as this many attention cells
# (query x key pairs); neighbouring length classes merge while that saves more than their padding adds. Calls
# count for more on a busy machine, where every parallel region waits for descheduled threads.
LAUNCH_CELLS = 32_768


# ---------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Bucket:
    """Sequences of similar length, laid out as a dense (n, max_len) block; padded slots hold zeros."""

    seq: torch.Tensor  # (n,) int64 sequence ids in the batch
    valid: torch.Tensor  # (n, max_len) bool: slot holds a real row
    padded: bool  # whether any slot is padding

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    @property
    def size(self) -> int:
        return self.valid.numel()


@dataclass(frozen=True)
class Layout:
    """The buckets of one jagged tensor, stacked in one padded buffer of ``sum(n * max_len)`` slots.

    Real row ``rows[i]`` of the jagged tensor sits in slot ``slots[i]`` of the buffer; no row or slot repeats.
    """

    buckets: list[Bucket]
    rows: torch.Tensor
    slots: torch.Tensor
    num_slots: int


def length_class(lens: torch.Tensor, budget: float = PAD_BUDGET, short_len: int = SHORT_LEN) -> torch.Tensor:
    """Bucket class per length: 0 up to ``short_len``, then one class per factor ``1 + budget``."""
    ratio = lens.double().clamp(min=short_len) / short_len
    cls = torch.floor(torch.log(ratio) / math.log1p(budget) + 1e-9).long() + 1
    return torch.where(lens <= short_len, torch.zeros_like(cls), cls)


def group_sequences(classes: torch.Tensor, keep: torch.Tensor) -> list[torch.Tensor]:
    """Ids of the kept sequences, one tensor per distinct class (vectorized; no loop over sequences)."""
    kept = keep.nonzero().squeeze(1)
    if kept.numel() == 0:
        return []
    cls = classes[kept]
    order = torch.argsort(cls, stable=True)
    _, counts = torch.unique_consecutive(cls[order], return_counts=True)
    return list(torch.split(kept[order], counts.tolist()))


def merge_groups(
    groups: list[torch.Tensor], q_lens: torch.Tensor, kv_lens: torch.Tensor, launch_cells: int | None = None
) -> list[torch.Tensor]:
    """Merge runs of neighbouring groups to minimize padded attention cells + ``launch_cells`` per bucket.

    A bucket of n sequences costs n * max_q * max_kv cells. Exact dynamic programme over contiguous runs of the
    (length-ordered) groups, at most O(groups^2) steps on a few dozen groups, never on sequences.
    """
    launch_cells = LAUNCH_CELLS if launch_cells is None else launch_cells
    counts = [g.numel() for g in groups]
    max_q = [int(q_lens[g].max()) for g in groups]
    max_kv = [int(kv_lens[g].max()) for g in groups]
    best, start = [0.0] + [math.inf] * len(groups), [0] * (len(groups) + 1)
    for end in range(1, len(groups) + 1):
        n = mq = mk = 0
        for first in range(end - 1, -1, -1):  # bucket = groups[first:end]
            n, mq, mk = n + counts[first], max(mq, max_q[first]), max(mk, max_kv[first])
            bucket_cost = n * mq * mk + launch_cells
            if bucket_cost >= best[end]:
                break  # reaching further back only grows this bucket: no better split remains
            if best[first] + bucket_cost < best[end]:
                best[end], start[end] = best[first] + bucket_cost, first
    merged, end = [], len(groups)
    while end > 0:
        merged.append(torch.cat(groups[start[end] : end]))
        end = start[end]
    return merged[::-1]


def layout(groups: list[torch.Tensor], offsets: torch.Tensor) -> Layout:
    """Stack the dense blocks of the given groups of non-empty sequences of ``offsets``."""
    buckets, rows, slots, start = [], [], [], 0
    for seq in groups:
        seq_lens = offsets[seq + 1] - offsets[seq]
        max_len = int(seq_lens.max())
        pos = torch.arange(max_len, device=offsets.device)
        valid = pos[None, :] < seq_lens[:, None]
        real = valid.flatten().nonzero().squeeze(1)
        rows.append((offsets[seq][:, None] + pos[None, :]).flatten()[real])
        slots.append(real + start)
        buckets.append(Bucket(seq, valid, bool(seq_lens.min() < max_len)))
        start += valid.numel()
    empty = offsets.new_zeros(0)
    return Layout(buckets, torch.cat(rows) if rows else empty, torch.cat(slots) if slots else empty, start)


def plan_self(offsets: torch.Tensor) -> Layout:
    """Buckets of the non-empty sequences of ``offsets``: ``length_class`` groups, merged by ``merge_groups``."""
    lens = offsets[1:] - offsets[:-1]
    return layout(merge_groups(group_sequences(length_class(lens), lens > 0), lens, lens), offsets)


def plan_cross(q_offsets: torch.Tensor, kv_offsets: torch.Tensor) -> tuple[Layout, Layout]:
    """Matching query and key buckets over the sequences that have both queries and keys."""
    q_lens = q_offsets[1:] - q_offsets[:-1]
    kv_lens = kv_offsets[1:] - kv_offsets[:-1]
    # A sequence costs (its query length x its key length): bucket on both length classes.
    q_cls = length_class(q_lens)
    classes = length_class(kv_lens) * (int(q_cls.max()) + 1 if q_cls.numel() else 1) + q_cls
    groups = merge_groups(group_sequences(classes, (q_lens > 0) & (kv_lens > 0)), q_lens, kv_lens)
    return layout(groups, q_offsets), layout(groups, kv_offsets)


# ------------------------------------------------------------------------------------------ moving rows
class _MoveRows(torch.autograd.Function):
    """``out = zeros(size); out[dst] = src[src_idx]`` for indices without repeats.

    Its backward is the same move in reverse (a gather and a copy), where autograd's index_select would
    scatter-add, several times slower on CPU.
    """

    @staticmethod
    def forward(
        ctx, src: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor, size: int
    ) -> torch.Tensor:
        ctx.save_for_backward(src_idx, dst_idx)
        ctx.src_size = src.shape[0]
        return src.new_zeros((size, *src.shape[1:])).index_copy_(0, dst_idx, src.index_select(0, src_idx))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        src_idx, dst_idx = ctx.saved_tensors
        grad_src = grad.new_zeros((ctx.src_size, *grad.shape[1:]))
        return grad_src.index_copy_(0, src_idx, grad.index_select(0, dst_idx)), None, None, None


def to_blocks(values: torch.Tensor, plan: Layout) -> list[torch.Tensor]:
    """(total, *rest) jagged -> per bucket (n, max_len, *rest), zeros in padded slots."""
    buffer = _MoveRows.apply(values, plan.rows, plan.slots, plan.num_slots)
    parts = buffer.split([b.size for b in plan.buckets])
    return [part.view(*b.valid.shape, *values.shape[1:]) for b, part in zip(plan.buckets, parts, strict=True)]


def from_blocks(blocks: list[torch.Tensor], plan: Layout, like: torch.Tensor) -> torch.Tensor:
    """Per bucket (n, max_len, H, D) -> the jagged output shaped like ``like``; rows no bucket covers stay zero."""
    if not blocks:
        return like.new_zeros(like.shape)
    buffer = torch.cat([blk.reshape(-1, *like.shape[1:]) for blk in blocks]).to(like.dtype)
    return _MoveRows.apply(buffer, plan.slots, plan.rows, like.shape[0])


def _sdpa(qb, kb, vb, mask, is_causal: bool = False) -> torch.Tensor:
    """SDPA on (n, L, H, D) blocks (it wants heads first)."""
    out = F.scaled_dot_product_attention(
        qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), attn_mask=mask, is_causal=is_causal
    )
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------------------------ bias
class _LookupBias(torch.autograd.Function):
    """``table[:, idx]`` for a small (H, buckets) bias table and a large index, with a lean backward.

    Autograd's own backward (index_put with accumulate, or embedding's) costs several times the attention at
    (H, n, L, L); summing each head's gradient with one 1-D ``scatter_add_`` measured 2-3x cheaper on CPU.
    """

    @staticmethod
    def forward(ctx, table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        # Kept as int16 (a quarter of int64) while the table allows: one index per (L x L) cell adds up.
        ctx.save_for_backward(idx.to(torch.int16) if table.shape[1] <= torch.iinfo(torch.int16).max else idx)
        ctx.table_shape, ctx.table_dtype = table.shape, table.dtype
        return table[:, idx]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (idx,) = ctx.saved_tensors
        flat = idx.flatten().long()
        out = torch.zeros(ctx.table_shape, dtype=torch.float32, device=grad.device)  # accumulate in fp32
        for head in range(out.shape[0]):
            out[head].scatter_add_(0, flat, grad[head].reshape(-1).float())
        return out.to(ctx.table_dtype), None


def bucket_bias(
    length: int,
    ts_block: torch.Tensor | None,
    pos_bias: torch.Tensor | None,
    time_bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """(1 or n, H, L, L) relative bias of one bucket (reference definition), in the tables' dtype."""
    bias = None
    if pos_bias is not None:
        idx = torch.arange(length, device=pos_bias.device)
        bucket_idx = pos_bucket(idx[:, None] - idx[None, :], (pos_bias.shape[1] - 1) // 2)
        bias = _LookupBias.apply(pos_bias, bucket_idx)[None]  # (1, H, L, L)
    if time_bias is not None:
        bucket_idx = time_bucket(ts_block[:, :, None] - ts_block[:, None, :], time_bias.shape[1])
        tb = _LookupBias.apply(time_bias, bucket_idx).transpose(0, 1)  # (n, H, L, L)
        bias = tb if bias is None else bias + tb
    return bias


def _causal_fill(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(L, L) additive mask: 0 on and below the diagonal, -inf above."""
    return torch.full((length, length), float("-inf"), dtype=dtype, device=device).triu(1)


def _key_fill(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n, 1, 1, L) additive mask: -inf on padded keys."""
    fill = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, float("-inf"))
    return fill[:, None, None, :]


# ----------------------------------------------------------------------------------------------- checks
def _check_jagged(name: str, values: torch.Tensor, offsets: torch.Tensor) -> None:
    if values.dim() != 3:
        raise ValueError(f"{name} must be (total, heads, head_dim), got shape {tuple(values.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"offsets of {name} must be a 1-D integer tensor of B + 1 entries, got {offsets.dtype} "
            f"of shape {tuple(offsets.shape)}"
        )
    if int(offsets[0]) != 0 or int(offsets[-1]) != values.shape[0]:
        raise ValueError(
            f"offsets of {name} must run from 0 to its {values.shape[0]} rows, "
            f"got {int(offsets[0])}..{int(offsets[-1])}"
        )
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"offsets of {name} must be non-decreasing")


def _check_like(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, {ref_name} {tuple(ref.shape)}: they must match"
            )


def _check_bias(heads: int, total: int, pos_bias, time_bias, timestamps) -> None:
    if pos_bias is not None and (
        pos_bias.dim() != 2 or pos_bias.shape[0] != heads or pos_bias.shape[1] % 2 == 0
    ):
        raise ValueError(f"pos_bias must be (heads={heads}, 2R + 1), got shape {tuple(pos_bias.shape)}")
    if time_bias is not None:
        if time_bias.dim() != 2 or time_bias.shape[0] != heads:
            raise ValueError(f"time_bias must be (heads={heads}, T), got shape {tuple(time_bias.shape)}")
        if timestamps is None:
            raise ValueError("time_bias needs timestamps: a (total,) tensor of seconds")
        if tuple(timestamps.shape) != (total,):
            raise ValueError(f"timestamps must be ({total},), got shape {tuple(timestamps.shape)}")


# ------------------------------------------------------------------------------------------------- ops
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
    _check_jagged("q", q, offsets)
    _check_like("q", q, k=k, v=v)
    _check_bias(q.shape[1], q.shape[0], pos_bias, time_bias, timestamps)
    plan = plan_self(offsets)
    ts_blocks = to_blocks(timestamps, plan) if time_bias is not None else [None] * len(plan.buckets)
    outs = []
    for bucket, qb, kb, vb, ts_block in zip(
        plan.buckets, to_blocks(q, plan), to_blocks(k, plan), to_blocks(v, plan), ts_blocks, strict=True
    ):
        bias = bucket_bias(bucket.max_len, ts_block, pos_bias, time_bias)
        if bias is not None:
            # SDPA takes either is_causal or a mask: fold causality / key padding into the additive bias.
            if causal:
                bias = bias + _causal_fill(bucket.max_len, bias.dtype, bias.device)
            elif bucket.padded:
                bias = bias + _key_fill(bucket.valid, bias.dtype)
            outs.append(_sdpa(qb, kb, vb, bias.to(q.dtype)))
        elif causal:
            outs.append(_sdpa(qb, kb, vb, None, is_causal=bucket.max_len > 1))
        else:
            outs.append(_sdpa(qb, kb, vb, bucket.valid[:, None, None, :] if bucket.padded else None))
    return from_blocks(outs, plan, q)


def jagged_cross_attention(
    q: torch.Tensor,
    q_offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
) -> torch.Tensor:
    """Each sequence's queries attend over that sequence's keys. q: (total_q, H, D); k, v: (total_kv, H, D)."""
    _check_jagged("q", q, q_offsets)
    _check_jagged("k", k, kv_offsets)
    _check_like("k", k, v=v)
    if q_offsets.numel() != kv_offsets.numel():
        raise ValueError(
            f"q_offsets has {q_offsets.numel() - 1} sequences, kv_offsets {kv_offsets.numel() - 1}: they must match"
        )
    if q.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"q rows {tuple(q.shape[1:])} and k rows {tuple(k.shape[1:])} must share (heads, head_dim)"
        )
    q_plan, kv_plan = plan_cross(q_offsets, kv_offsets)
    outs = []
    for kv_bucket, qb, kb, vb in zip(
        kv_plan.buckets, to_blocks(q, q_plan), to_blocks(k, kv_plan), to_blocks(v, kv_plan), strict=True
    ):
        outs.append(_sdpa(qb, kb, vb, kv_bucket.valid[:, None, None, :] if kv_bucket.padded else None))
    return from_blocks(outs, q_plan, q)
