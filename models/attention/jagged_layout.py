"""Length buckets of the jagged CPU attention path, and the moves of rows between jagged and bucket layouts.

``plan_self`` / ``plan_cross`` group the non-empty sequences by length class and merge neighbouring classes where
one kernel call fewer saves more than the padding it adds (see ``models.attention.jagged`` for the whole path);
``to_blocks`` / ``from_blocks`` move rows into every bucket's dense (n, max_len) block and back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from models.architectures.transforms import lengths

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
