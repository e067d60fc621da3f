"""Padded ``scaled_dot_product_attention``: the baseline a GPU user would write without jagged kernels.

Pads the jagged batch to its longest sequence, folds the relative bias and the padding/causal masks into one
additive ``attn_mask`` and calls ``torch.nn.functional.scaled_dot_product_attention`` (on CUDA the
memory-efficient kernel, which takes an arbitrary mask). It pays for the padding in time and memory; the
Triton kernels are measured against it. Same signature and semantics as ``models.attention.reference``.

A query row with no key to attend to (a padded row, or a sequence without keys) is pointed at key 0, which is
zero-padded or dropped on unpad: its output is 0 and no NaN reaches the backward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.attention import validate
from models.attention.reference import pad, relative_bias, unpad


def _additive_mask(allowed: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1|H, Nq, Nk) bool -> float mask: 0 where allowed, -inf elsewhere, plus the bias."""
    no_key = ~allowed.any(-1, keepdim=True)
    first = torch.zeros_like(allowed)
    first[..., 0] = True
    allowed = allowed | (no_key & first)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))
    return mask if bias is None else mask + bias.to(dtype)


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
    validate.check_self_attention(q, k, v, offsets, pos_bias, time_bias, timestamps)
    if q.shape[0] == 0:
        return torch.zeros_like(q)
    qp, mask = pad(q, offsets)
    kp, _ = pad(k, offsets)
    vp, _ = pad(v, offsets)
    n = qp.shape[1]
    ts_pad = pad(timestamps, offsets)[0] if timestamps is not None else None
    allowed = mask[:, None, None, :].expand(-1, 1, n, -1)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    attn_mask = _additive_mask(allowed, relative_bias(ts_pad, n, pos_bias, time_bias), q.dtype)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), attn_mask
    )
    return unpad(out.transpose(1, 2), mask)


def jagged_cross_attention(
    q: torch.Tensor,
    q_offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
) -> torch.Tensor:
    validate.check_cross_attention(q, q_offsets, k, v, kv_offsets)
    if q.shape[0] == 0:
        return torch.zeros_like(q)
    qp, qmask = pad(q, q_offsets)
    kp, kmask = pad(k, kv_offsets)
    vp, _ = pad(v, kv_offsets)
    if kp.shape[1] == 0:  # no sequence has keys
        return torch.zeros_like(q)
    allowed = kmask[:, None, None, :].expand(-1, 1, qp.shape[1], -1)
    attn_mask = _additive_mask(allowed, None, q.dtype)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), attn_mask
    )
    return unpad(out.transpose(1, 2), qmask)
