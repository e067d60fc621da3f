"""CPU fast path for jagged attention: length buckets, never paying for the batch's longest sequence.

Same ops and signatures as ``models.attention.reference`` (read its docstring for the layout, the relative
position / time bias and the empty-sequence semantics). How it avoids padding:

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

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.architectures.transforms import lengths, time_bucket
from models.attention import bucket_kernel, validate
from models.attention.reference import pos_bucket

PAD_BUDGET = 0.125  # at most this fraction of a bucket's tokens is padding (above SHORT_LEN)
SHORT_LEN = 16  # sequences this short share one bucket: their padding costs less than another kernel call
# One more SDPA call (forward + backward, ~a dozen kernels) costs about as much as this many attention cells
# (query x key pairs); neighbouring length classes merge while that saves more than their padding adds. Calls
# count for more on a busy machine, where every parallel region waits for descheduled threads.
LAUNCH_CELLS = 32_768
# PyTorch's fused CPU attention costs ~3x per sequence once a call's keys exceed 16 (measured, bf16, 4 queries x
# 64 dims: fwd+bwd 90 us per sequence and head-group at 16 keys, 267 at 24, 334 at 42): padding short-key
# sequences into a longer-key bucket costs far more than the cells count, so buckets are merged on each side of
# this length, never across it (``merge_on_each_side_of_the_cliff``).
KV_CLIFF = 16


# ---------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Bucket:
    """Sequences of similar length, laid out as a dense (n, max_len) block; padded slots hold zeros."""

    seq: torch.Tensor  # (n,) int64 sequence ids in the batch
    valid: torch.Tensor  # (n, max_len) bool: slot holds a real row
    padded: bool  # whether any slot is padding
    slot_rows: torch.Tensor  # (n * max_len,) int64 each slot's row; a padded slot repeats its sequence's last
    start: int  # the bucket's first slot in the buffer of all buckets

    @property
    def n(self) -> int:
        return self.valid.shape[0]

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
    ``identity``: the buffer is the jagged tensor itself (no padding, rows in order, e.g. a batch of equal
    lengths such as users whose history fills ``max_history``), so no rows need to move.
    """

    buckets: list[Bucket]
    rows: torch.Tensor
    slots: torch.Tensor
    num_slots: int
    identity: bool = False


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


def merge_on_each_side_of_the_cliff(
    groups: list[torch.Tensor], q_lens: torch.Tensor, kv_lens: torch.Tensor
) -> list[torch.Tensor]:
    """``merge_groups`` separately over the groups whose keys fit under ``KV_CLIFF`` and over the others."""
    short = [g for g in groups if int(kv_lens[g].max()) <= KV_CLIFF]
    long = [g for g in groups if int(kv_lens[g].max()) > KV_CLIFF]
    return [*merge_groups(short, q_lens, kv_lens), *merge_groups(long, q_lens, kv_lens)]


def layout(groups: list[torch.Tensor], offsets: torch.Tensor) -> Layout:
    """Stack the dense blocks of the given groups of non-empty sequences of ``offsets``."""
    buckets, rows, slots, start = [], [], [], 0
    for seq in groups:
        seq_lens = offsets[seq + 1] - offsets[seq]
        max_len = int(seq_lens.max())
        pos = torch.arange(max_len, device=offsets.device)
        valid = pos[None, :] < seq_lens[:, None]
        real = valid.flatten().nonzero().squeeze(1)
        slot_rows = (offsets[seq][:, None] + torch.minimum(pos[None, :], seq_lens[:, None] - 1)).flatten()
        rows.append(slot_rows[real])
        slots.append(real + start)
        buckets.append(Bucket(seq, valid, bool(seq_lens.min() < max_len), slot_rows, start))
        start += valid.numel()
    empty = offsets.new_zeros(0)
    rows, slots = (torch.cat(rows), torch.cat(slots)) if rows else (empty, empty)
    identity = start == int(offsets[-1]) and torch.equal(rows, slots)
    return Layout(buckets, rows, slots, start, identity)


def plan_self(offsets: torch.Tensor) -> Layout:
    """Buckets of the non-empty sequences of ``offsets``: ``length_class`` groups, merged by ``merge_groups``."""
    lens = lengths(offsets)
    return layout(
        merge_on_each_side_of_the_cliff(group_sequences(length_class(lens), lens > 0), lens, lens), offsets
    )


def plan_cross(q_offsets: torch.Tensor, kv_offsets: torch.Tensor) -> tuple[Layout, Layout]:
    """Matching query and key buckets over the sequences that have both queries and keys."""
    q_lens, kv_lens = lengths(q_offsets), lengths(kv_offsets)
    # A sequence costs (its query length x its key length): bucket on both length classes.
    q_cls = length_class(q_lens)
    classes = length_class(kv_lens) * (int(q_cls.max()) + 1 if q_cls.numel() else 1) + q_cls
    groups = merge_on_each_side_of_the_cliff(
        group_sequences(classes, (q_lens > 0) & (kv_lens > 0)), q_lens, kv_lens
    )
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
    buffer = values if plan.identity else _MoveRows.apply(values, plan.rows, plan.slots, plan.num_slots)
    parts = buffer.split([b.size for b in plan.buckets])
    return [
        part.reshape(*b.valid.shape, *values.shape[1:]) for b, part in zip(plan.buckets, parts, strict=True)
    ]


def from_blocks(blocks: list[torch.Tensor], plan: Layout, like: torch.Tensor) -> torch.Tensor:
    """Per bucket (n, max_len, H, D) -> the jagged output shaped like ``like``; rows no bucket covers stay zero."""
    if not blocks:
        return like.new_zeros(like.shape)
    flat = [blk.reshape(-1, *like.shape[1:]) for blk in blocks]
    buffer = (flat[0] if len(flat) == 1 else torch.cat(flat)).to(like.dtype)
    return buffer if plan.identity else _MoveRows.apply(buffer, plan.slots, plan.rows, like.shape[0])


def _sdpa(qb, kb, vb, mask, is_causal: bool = False) -> torch.Tensor:
    """SDPA on (n, L, H, D) blocks (it wants heads first)."""
    out = F.scaled_dot_product_attention(
        qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), attn_mask=mask, is_causal=is_causal
    )
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------------------------ bias
# The bias of one layer is ``table[h, column(b, i, j)]``: the per-pair column (relative position bucket x
# time-gap bucket, or a masked column) depends only on the offsets and timestamps, which every layer of a
# forward pass shares. So the columns are computed once per batch (``SelfPlan``) and each layer pays a single
# gather from its small combined (H, P * T + 1) table straight into the SDPA mask, in the mask's dtype.
@dataclass(frozen=True)
class SelfPlan:
    """Buckets of one self-attention batch and, per bucket, each cell's index into the flat combined table.

    ``bias_index[i]`` is None (no bias tables) or (n or 1, H, L, L) int32: ``h * columns + c`` where column
    ``c = pos_bucket * T + time_bucket`` (P = T = 1 for an absent table) or ``columns - 1``, the -inf column,
    for a cell the query must not see (a later key when causal, a padded key).
    """

    layout: Layout
    bias_index: list[torch.Tensor | None]
    pos_columns: int  # P: columns of pos_bias, 0 = no table
    time_columns: int  # T: columns of time_bias, 0 = no table
    masks: list[torch.Tensor | None]  # without tables: each bucket's additive fp32 causal / key-padding mask
    qkv_moves: bucket_kernel.HeadsFirst  # packed q/k/v rows <-> the bucket kernel's heads-first buffer
    out_moves: bucket_kernel.HeadsFirst  # output rows <-> its buffer

    @property
    def columns(self) -> int:
        return max(self.pos_columns, 1) * max(self.time_columns, 1) + 1


def bucket_columns(
    bucket: Bucket, ts_block: torch.Tensor | None, causal: bool, pos_columns: int, time_columns: int
) -> torch.Tensor:
    """(n or 1, L, L) int32 column of every cell of one bucket in the combined table (see ``SelfPlan``)."""
    length, device = bucket.max_len, bucket.valid.device
    col = torch.zeros((1, length, length), dtype=torch.int32, device=device)
    if pos_columns:
        pos = torch.arange(length, device=device, dtype=torch.int32)
        col += pos_bucket(pos[:, None] - pos[None, :], (pos_columns - 1) // 2) * max(time_columns, 1)
    if time_columns:
        gaps = ts_block[:, :, None] - ts_block[:, None, :]
        col = col + time_bucket(gaps, time_columns, out_int32=True)  # (n, L, L)
    masked = max(pos_columns, 1) * max(time_columns, 1)  # the last column: -inf
    if causal:
        col = col.masked_fill_(torch.ones(length, length, dtype=torch.bool, device=device).triu(1), masked)
    elif bucket.padded:  # padded keys sit at the end; a padded query row still sees its sequence's keys
        col = col.masked_fill(~bucket.valid[:, None, :], masked)
    return col


def plan_self_attention(
    offsets: torch.Tensor,
    timestamps: torch.Tensor | None,
    *,
    causal: bool,
    heads: int,
    pos_columns: int,
    time_columns: int,
) -> SelfPlan:
    """Buckets (``plan_self``) and, when there is a bias table, every bucket's combined-table index."""
    plan = plan_self(offsets)
    total = int(offsets[-1])
    moves = [bucket_kernel.heads_first(plan.buckets, parts, heads, total) for parts in (3, 1)]
    if not pos_columns and not time_columns:
        masks = [additive_mask(b, causal) for b in plan.buckets]
        return SelfPlan(plan, [None] * len(plan.buckets), 0, 0, masks, *moves)
    ts_blocks = to_blocks(timestamps, plan) if time_columns else [None] * len(plan.buckets)
    columns = max(pos_columns, 1) * max(time_columns, 1) + 1
    head_base = (torch.arange(heads, device=offsets.device, dtype=torch.int32) * columns).view(1, heads, 1, 1)
    index = [
        bucket_columns(b, ts, causal, pos_columns, time_columns)[:, None] + head_base
        for b, ts in zip(plan.buckets, ts_blocks, strict=True)
    ]
    return SelfPlan(plan, index, pos_columns, time_columns, [None] * len(plan.buckets), *moves)


def additive_mask(bucket: Bucket, causal: bool) -> torch.Tensor | None:
    """fp32 0 / -inf mask of one bucket broadcastable to (n, H, L, L): causal (L, L) (padding then needs none:
    it sits at the end of each sequence), else the padded keys (n, 1, 1, L); None when nothing is masked."""
    length, device = bucket.max_len, bucket.valid.device
    if causal:
        return torch.full((length, length), float("-inf"), device=device).triu_(1) if length > 1 else None
    if not bucket.padded:
        return None
    mask = torch.zeros(bucket.valid.shape, device=device).masked_fill_(~bucket.valid, float("-inf"))
    return mask[:, None, None, :]


class _PlanCache(threading.local):
    """The last plan built in this thread, with copies of the inputs it was built from.

    The layers of one forward pass pass the same offsets and timestamps: comparing them (O(total)) is far
    cheaper than rebuilding the per-cell index (O(total x L)). Copies, not references, so an in-place change
    of the inputs can never return a stale plan.
    """

    key: tuple | None = None
    offsets: torch.Tensor | None = None
    timestamps: torch.Tensor | None = None
    plan: SelfPlan | None = None


_CACHE = _PlanCache()


def _same(kept: torch.Tensor | None, new: torch.Tensor | None) -> bool:
    if kept is None or new is None:
        return kept is None and new is None
    return kept.dtype == new.dtype and kept.shape == new.shape and torch.equal(kept, new)


def cached_plan_self_attention(offsets: torch.Tensor, timestamps: torch.Tensor | None, **kwargs) -> SelfPlan:
    """``plan_self_attention``, reused while the same batch comes back (the next layer of the same pass)."""
    # Inference tensors cannot be saved for a later backward: plans built in inference mode stay there.
    # The planner's tuning constants are part of the key: tests patch them to force other layouts.
    key = (
        tuple(sorted(kwargs.items())),
        offsets.device,
        torch.is_inference_mode_enabled(),
        (PAD_BUDGET, SHORT_LEN, LAUNCH_CELLS),
    )
    if not kwargs["time_columns"]:
        timestamps = None
    if _CACHE.key == key and _same(_CACHE.offsets, offsets) and _same(_CACHE.timestamps, timestamps):
        return _CACHE.plan
    plan = plan_self_attention(offsets, timestamps, **kwargs)
    _CACHE.key, _CACHE.plan = key, plan
    _CACHE.offsets = offsets.clone()
    _CACHE.timestamps = timestamps.clone() if timestamps is not None else None
    return plan


def clear_plan_cache() -> None:
    """Drop the cached plan (it holds one batch's per-cell index) of this thread."""
    _CACHE.key = _CACHE.offsets = _CACHE.timestamps = _CACHE.plan = None


def combined_table(
    pos_bias: torch.Tensor | None, time_bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """(H * (P * T + 1),) flat: ``pos_bias[h, p] + time_bias[h, t]`` at column p * T + t, then -inf."""
    ref = pos_bias if pos_bias is not None else time_bias
    pos = pos_bias if pos_bias is not None else ref.new_zeros(ref.shape[0], 1)
    time = time_bias if time_bias is not None else ref.new_zeros(ref.shape[0], 1)
    table = (pos.float()[:, :, None] + time.float()[:, None, :]).flatten(1)
    masked = table.new_full((table.shape[0], 1), float("-inf"))
    return torch.cat([table, masked], 1).to(dtype).flatten()


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
