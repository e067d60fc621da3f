"""CPU fast path for jagged attention: length buckets + fused SDPA, never paying for the batch's longest sequence.

Same ops and signatures as ``models.attention.reference`` (read its docstring for the layout, the relative
position / time bias and the empty-sequence semantics). How it avoids padding:

1. ``plan_buckets`` groups the non-empty sequences by length class (all lengths up to ``SHORT_LEN`` share one
   class; above it, classes grow geometrically by ``1 + PAD_BUDGET``), so a bucket padded to its own longest
   sequence wastes at most ``PAD_BUDGET`` of its tokens. Gather indices come from the offsets in a few vectorized
   ops; the only Python loop is over buckets (a few dozen at most), never over sequences.
2. Each bucket runs ``torch.nn.functional.scaled_dot_product_attention`` on (n_b, H, L_b, D): the fused CPU
   kernel when no bias needs a gradient, PyTorch's math kernel otherwise. The relative bias is built per bucket
   at (n_b or 1, H, L_b, L_b), never at (B, H, N_max, N_max). Causal buckets need no key-padding mask: padding
   sits at the end, so a real query never sees a padded key.
3. The valid rows of every bucket are written back into one (total, H, D) output by a single ``index_copy``;
   rows no bucket writes (cross-attention queries whose sequence has no keys) stay zero.

Autograd runs through these plain torch ops (forward and backward). bf16 inputs stay bf16 inside SDPA, whose
CPU kernels accumulate in fp32; the bias tables are gathered in their own dtype, so their gradients accumulate
in fp32 when the tables are fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.attention.reference import pos_bucket, time_bucket

PAD_BUDGET = 0.125  # at most this fraction of a bucket's tokens is padding (above SHORT_LEN)
SHORT_LEN = 16  # sequences this short share one bucket: their padding costs less than another kernel call


@dataclass(frozen=True)
class Bucket:
    """Sequences of similar length, laid out as a dense (n, max_len) block of rows of the jagged tensor."""

    seq: torch.Tensor  # (n,) int64 sequence ids in the batch
    rows: torch.Tensor  # (n, max_len) int64 jagged row; padded slots repeat the first row
    valid: torch.Tensor  # (n, max_len) bool: slot holds a real row
    max_len: int
    padded: bool  # whether any slot is padding

    @property
    def valid_slots(self) -> torch.Tensor:
        """Flat indices of the real slots in the (n * max_len) block."""
        return self.valid.flatten().nonzero().squeeze(1)


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


def block(seq: torch.Tensor, offsets: torch.Tensor) -> Bucket:
    """The dense (n, max_len) block of the given non-empty sequences of ``offsets``."""
    seq_lens = offsets[seq + 1] - offsets[seq]
    max_len = int(seq_lens.max())
    slot = torch.arange(max_len, device=offsets.device)
    valid = slot[None, :] < seq_lens[:, None]
    rows = offsets[seq][:, None] + torch.where(valid, slot[None, :], 0)
    return Bucket(seq, rows, valid, max_len, bool(seq_lens.min() < max_len))


def plan_buckets(offsets: torch.Tensor) -> list[Bucket]:
    """Buckets of the non-empty sequences of ``offsets``, grouped by ``length_class``."""
    lens = offsets[1:] - offsets[:-1]
    return [block(seq, offsets) for seq in group_sequences(length_class(lens), lens > 0)]


def _gather(values: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """(total, H, D) -> (n, H, max_len, D) for SDPA."""
    n, length = bucket.rows.shape
    block = values.index_select(0, bucket.rows.flatten()).view(n, length, *values.shape[1:])
    return block.transpose(1, 2)


def _scatter_valid(out_block: torch.Tensor, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, H, max_len, D) SDPA output -> (its jagged rows, their real rows)."""
    n, h, length, d = out_block.shape
    flat = out_block.transpose(1, 2).reshape(n * length, h, d)
    slots = bucket.valid_slots
    return bucket.rows.flatten()[slots], flat.index_select(0, slots)


def _assemble(like: torch.Tensor, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    out = like.new_zeros(like.shape)
    if not pieces:
        return out
    rows = torch.cat([r for r, _ in pieces])
    vals = torch.cat([v for _, v in pieces]).to(like.dtype)
    return out.index_copy(0, rows, vals)


def _bucket_bias(
    bucket: Bucket,
    ts: torch.Tensor | None,
    pos_bias: torch.Tensor | None,
    time_bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """(1 or n, H, L, L) relative bias for one bucket, fp32 or the tables' dtype."""
    length = bucket.max_len
    bias = None
    if pos_bias is not None:
        idx = torch.arange(length, device=pos_bias.device)
        bucket_idx = pos_bucket(idx[:, None] - idx[None, :], (pos_bias.shape[1] - 1) // 2)
        bias = pos_bias[:, bucket_idx][None]
    if time_bias is not None:
        ts_block = ts[bucket.rows]  # (n, L)
        bucket_idx = time_bucket(ts_block[:, :, None] - ts_block[:, None, :], time_bias.shape[1])
        tb = F.embedding(bucket_idx, time_bias.t()).permute(0, 3, 1, 2)  # (n, H, L, L)
        bias = tb if bias is None else bias + tb
    return bias


def _check_jagged(name: str, values: torch.Tensor, offsets: torch.Tensor) -> None:
    if values.dim() != 3:
        raise ValueError(f"{name} must be (total, heads, head_dim), got shape {tuple(values.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name} offsets must be a 1-D integer tensor of B + 1 entries, got {offsets.dtype} "
            f"shape {tuple(offsets.shape)}"
        )
    if int(offsets[0]) != 0 or int(offsets[-1]) != values.shape[0]:
        raise ValueError(
            f"{name} offsets must start at 0 and end at {values.shape[0]} (its rows), "
            f"got {int(offsets[0])}..{int(offsets[-1])}"
        )
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"{name} offsets must be non-decreasing")


def _check_same_layout(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.shape[0] != ref.shape[0] or t.shape[1:] != ref.shape[1:]:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} does not match {ref_name} shape {tuple(ref.shape)}"
            )


def _check_bias(heads: int, pos_bias, time_bias, timestamps, total: int) -> None:
    if pos_bias is not None and (
        pos_bias.dim() != 2 or pos_bias.shape[0] != heads or pos_bias.shape[1] % 2 == 0
    ):
        raise ValueError(f"pos_bias must be (heads={heads}, 2R + 1), got shape {tuple(pos_bias.shape)}")
    if time_bias is not None:
        if time_bias.dim() != 2 or time_bias.shape[0] != heads:
            raise ValueError(f"time_bias must be (heads={heads}, T), got shape {tuple(time_bias.shape)}")
        if timestamps is None:
            raise ValueError("time_bias needs timestamps (total,) in seconds")
        if timestamps.shape != (total,):
            raise ValueError(f"timestamps must be ({total},), got shape {tuple(timestamps.shape)}")


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
    _check_same_layout("q", q, k=k, v=v)
    _check_bias(q.shape[1], pos_bias, time_bias, timestamps, q.shape[0])
    pieces = []
    for bucket in plan_buckets(offsets):
        qb, kb, vb = _gather(q, bucket), _gather(k, bucket), _gather(v, bucket)
        bias = _bucket_bias(bucket, timestamps, pos_bias, time_bias)
        mask, is_causal = None, False
        if bias is not None:
            # SDPA takes either is_causal or a mask: fold causality / key padding into the additive bias.
            if causal:
                bias = bias + _causal_fill(bucket.max_len, bias.dtype, bias.device)
            elif bucket.padded:
                bias = bias + _key_fill(bucket.valid, bias.dtype)
            mask = bias.to(q.dtype)
        elif causal:
            is_causal = bucket.max_len > 1
        elif bucket.padded:
            mask = bucket.valid[:, None, None, :]
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=is_causal)
        pieces.append(_scatter_valid(out, bucket))
    return _assemble(q, pieces)


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
    _check_same_layout("k", k, v=v)
    if q_offsets.numel() != kv_offsets.numel():
        raise ValueError(
            f"q_offsets has {q_offsets.numel() - 1} sequences, kv_offsets {kv_offsets.numel() - 1}"
        )
    if q.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"q rows {tuple(q.shape[1:])} and k rows {tuple(k.shape[1:])} must share (heads, head_dim)"
        )
    q_lens = q_offsets[1:] - q_offsets[:-1]
    kv_lens = kv_offsets[1:] - kv_offsets[:-1]
    # A sequence costs (its query length x its key length): bucket on both length classes. Sequences without
    # keys are left out, so their query rows are never written and stay zero.
    q_cls = length_class(q_lens)
    classes = length_class(kv_lens) * (int(q_cls.max()) + 1 if q_cls.numel() else 1) + q_cls
    pieces = []
    for seq in group_sequences(classes, (q_lens > 0) & (kv_lens > 0)):
        q_block, kv_block = block(seq, q_offsets), block(seq, kv_offsets)
        qb, kb, vb = _gather(q, q_block), _gather(k, kv_block), _gather(v, kv_block)
        mask = kv_block.valid[:, None, None, :] if kv_block.padded else None
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
        pieces.append(_scatter_valid(out, q_block))
    return _assemble(q, pieces)


def _causal_fill(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(L, L) additive mask: 0 on and below the diagonal, -inf above."""
    return torch.full((length, length), float("-inf"), dtype=dtype, device=device).triu(1)


def _key_fill(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n, 1, 1, L) additive mask: -inf on padded keys."""
    fill = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, float("-inf"))
    return fill[:, None, None, :]
