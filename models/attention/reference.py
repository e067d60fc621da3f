"""Plain PyTorch reference for the two attention shapes the models use (pad + mask; correctness, not speed).

Jagged layout: a batch of B sequences is ``values`` of shape (total, H, D) and ``offsets`` (B + 1,) int64,
sequence b owning rows ``offsets[b]:offsets[b+1]``. Every fast backend must match these functions.

Relative bias (self-attention): for query i and key j of the same sequence,
    bias[h, i, j] = pos_bias[h, pos_bucket(i - j)] + time_bias[h, time_bucket(ts[i] - ts[j])]
with ``pos_bucket(r) = clamp(r, -R, R) + R`` (pos_bias has 2R + 1 columns) and
``time_bucket(t) = clamp(floor(log2(1 + |t|)), 0, T - 1)`` for t in seconds (time_bias has T columns).

Cross-attention: queries are jagged too (``q_offsets``: K summary queries per user, or N candidates against
one user); a query whose sequence has no keys returns zeros.
"""

from __future__ import annotations

import math

import torch

from models.architectures.transforms import (  # one definition, shared with the data pipeline
    lengths,
    time_bucket,
)


def pad(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, *rest) -> (B, N, *rest) zero-padded, and the (B, N) validity mask."""
    lens = lengths(offsets)
    n = int(lens.max()) if max_len is None and lens.numel() else (max_len or 0)
    b = lens.numel()
    mask = torch.arange(n, device=values.device)[None, :] < lens[:, None]
    out = values.new_zeros((b, n, *values.shape[1:]))
    out[mask] = values
    return out, mask


def unpad(padded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return padded[mask]


def pos_bucket(rel: torch.Tensor, max_rel: int) -> torch.Tensor:
    return rel.clamp(-max_rel, max_rel) + max_rel


def relative_bias(
    ts_pad: torch.Tensor | None,
    n: int,
    pos_bias: torch.Tensor | None,
    time_bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """(B, H, N, N) additive bias, or None when neither table is given."""
    bias = None
    if pos_bias is not None:
        idx = torch.arange(n, device=pos_bias.device)
        max_rel = (pos_bias.shape[1] - 1) // 2
        bucket = pos_bucket(idx[:, None] - idx[None, :], max_rel)  # (N, N)
        bias = pos_bias[:, bucket][None]  # (1, H, N, N)
    if time_bias is not None:
        assert ts_pad is not None, "time_bias needs timestamps"
        bucket = time_bucket(ts_pad[:, :, None] - ts_pad[:, None, :], time_bias.shape[1])  # (B, N, N)
        tb = time_bias[:, bucket].permute(1, 0, 2, 3)  # (B, H, N, N)
        bias = tb if bias is None else bias + tb
    return bias


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
    if q.shape[0] == 0:
        return torch.zeros_like(q)
    d = q.shape[-1]
    qp, mask = pad(q, offsets)
    kp, _ = pad(k, offsets)
    vp, _ = pad(v, offsets)
    n = qp.shape[1]
    ts_pad = pad(timestamps, offsets)[0] if timestamps is not None else None
    scores = torch.einsum("bihd,bjhd->bhij", qp.float(), kp.float()) / math.sqrt(d)
    bias = relative_bias(ts_pad, n, pos_bias, time_bias)
    if bias is not None:
        scores = scores + bias.float()
    allowed = mask[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows are all -inf
    out = torch.einsum("bhij,bjhd->bihd", probs, vp.float())
    return unpad(out, mask).to(q.dtype)


def jagged_cross_attention(
    q: torch.Tensor,
    q_offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
) -> torch.Tensor:
    """Each sequence's queries attend over that sequence's keys. q: (total_q, H, D); k, v: (total_kv, H, D)."""
    if q.shape[0] == 0:
        return torch.zeros_like(q)
    d = q.shape[-1]
    qp, qmask = pad(q, q_offsets)
    kp, kmask = pad(k, kv_offsets)
    vp, _ = pad(v, kv_offsets)
    if kp.shape[1] == 0:  # no sequence has keys
        return torch.zeros_like(q)
    scores = torch.einsum("bihd,bjhd->bhij", qp.float(), kp.float()) / math.sqrt(d)
    scores = scores.masked_fill(~kmask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty key set -> zeros
    out = torch.einsum("bhij,bjhd->bihd", probs, vp.float())
    return unpad(out, qmask).to(q.dtype)
