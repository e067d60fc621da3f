"""The per-batch plan of jagged self-attention: its buckets plus each cell's column in the bias table.

The bias of one layer is ``table[h, column(b, i, j)]``: the per-pair column (relative position bucket x
time-gap bucket, or a masked column) depends only on the offsets and timestamps, which every layer of a
forward pass shares. So the columns are computed once per batch (``SelfPlan``) and each layer pays a single
gather from its small combined (H, P * T + 1) table straight into the SDPA mask, in the mask's dtype.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from models.architectures.transforms import time_bucket
from models.attention import bucket_kernel, jagged_layout
from models.attention.jagged_layout import Bucket, Layout, plan_self, to_blocks
from models.attention.reference import pos_bucket


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
        (jagged_layout.PAD_BUDGET, jagged_layout.SHORT_LEN, jagged_layout.LAUNCH_CELLS),
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
