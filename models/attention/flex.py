"""torch's FlexAttention as a jagged backend: the well-kept library measured against our own kernels.

The jagged batch is packed as one sequence of ``total`` rows (batch 1, no padding); a block mask keeps each
query inside its own sequence (``doc[q] == doc[kv]``, and ``q >= kv`` when causal), and a ``score_mod`` adds the
relative bias of ``models.attention.reference`` (position bucket of ``q - kv``, which inside one packed sequence
is the in-sequence distance, and ``floor(log2(1 + |ts[q] - ts[kv]|))`` computed in float64 so that gaps just
under a power of two do not round up into the next bucket). ``flex_attention`` is compiled once per process and
the block mask is built compiled too (``_compile=True``: 0.27 s instead of 2.1 s for 19,599 rows on one thread);
both are compiled for fixed shapes, so every new batch size compiles again (not counted in the bench's steps).

Not a backend the models dispatch to: ``bench/jagged.py --backends reference,jagged,flex`` measures it beside
ours, and the figures in ``docs/training-speed.md`` say why it is not used (issue 40: where it is as fast, use
it and delete ours). Same signature and semantics as ``models.attention.reference``.
"""

from __future__ import annotations

from functools import cache

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from models.architectures.transforms import lengths
from models.attention import validate


@cache
def _compiled():
    return torch.compile(flex_attention, dynamic=False)


def _doc_ids(offsets: torch.Tensor) -> torch.Tensor:
    """(total,) the sequence each packed row belongs to."""
    lens = lengths(offsets)
    return torch.repeat_interleave(torch.arange(lens.numel(), device=offsets.device), lens)


def _packed(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # (total, H, D) -> (1, H, total, D)


def _unpacked(x: torch.Tensor) -> torch.Tensor:
    return x.squeeze(0).transpose(0, 1)


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
    total = q.shape[0]
    if total == 0:
        return torch.zeros_like(q)
    doc = _doc_ids(offsets)

    def mask_mod(b, h, qi, ki):
        same = doc[qi] == doc[ki]
        return same & (qi >= ki) if causal else same

    score_mod = None
    if pos_bias is not None or time_bias is not None:
        ts = timestamps.to(torch.float64) if time_bias is not None else None
        max_rel = (pos_bias.shape[1] - 1) // 2 if pos_bias is not None else 0
        n_time = time_bias.shape[1] if time_bias is not None else 0

        def score_mod(score, b, h, qi, ki):
            if pos_bias is not None:
                score = score + pos_bias[h, (qi - ki).clamp(-max_rel, max_rel) + max_rel]
            if time_bias is not None:
                gap = torch.floor(torch.log2(1.0 + (ts[qi] - ts[ki]).abs())).clamp(0, n_time - 1)
                score = score + time_bias[h, gap.to(torch.int64)]
            return score

    block = create_block_mask(mask_mod, None, None, total, total, device=q.device, _compile=True)
    out = _compiled()(_packed(q), _packed(k), _packed(v), score_mod=score_mod, block_mask=block)
    return _unpacked(out)


def jagged_cross_attention(
    q: torch.Tensor,
    q_offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
) -> torch.Tensor:
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q)
    q_doc, kv_doc = _doc_ids(q_offsets), _doc_ids(kv_offsets)

    def mask_mod(b, h, qi, ki):
        return q_doc[qi] == kv_doc[ki]

    block = create_block_mask(mask_mod, None, None, q.shape[0], k.shape[0], device=q.device, _compile=True)
    out = _compiled()(_packed(q), _packed(k), _packed(v), block_mask=block)
    return _unpacked(out)
