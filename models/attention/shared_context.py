"""Attention of many queries over ONE shared context, for inference: every candidate of a serving request reads
the same user's K/V (``Ranker.score`` with one user).

    O = softmax(Q K^T / sqrt(d)) V,   per head,   Q (N, H, d),  K, V (T, H, d),  N >> T (1,000 candidates, ~66 tokens)

computed as two batched GEMMs around a softmax in base 2: the scale and log2(e) are folded into K once per request
(``context_layout``), so the scores are already in log2 units and ``exp2(S) / sum`` is the softmax. Subtracting
each row's max (what keeps exp from overflowing) costs two more passes over the N x T scores; it is done only when
a row's sum shows that it is needed (a score beyond ~2^100 or all of a row's below ~2^-60, far outside what a
trained model produces), so the result is the same softmax either way.

Why not SDPA: on CPU its flash kernel walks 256-query tiles with a small GEMM pair and a scalar ``exp`` per row and
tile, and its element-wise exponentials are the 1-ulp ``exp``; ``torch.exp2`` (also 1 ulp) runs ~3.5x faster than
``torch.exp`` on this AMD EPYC (264 k floats: 0.061 vs 0.22 ms, one thread). Two target-aware blocks of a
1,000-candidate request: 2.06 -> 1.53 ms of CPU, measured side by side (docs/serving-speed.md). Differences to SDPA
are float32 rounding (~1e-6 relative; the tests compare with ``reference_attend``).

``FusedAttention`` is the same attention as one C++ op (``shared_context_attend.cpp``, ``models.inference.native``):
scores, softmax and values a few rows at a time in registers, none of the (H, N, T) intermediates written out; the
serving path uses it where the op is built (``TorchAttention`` calls ``attend``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# exp2 of row sums inside (2^-60, 2^100): no term overflowed (each < 2^127) and the sum kept float32's precision
# (no normal term lost below 2^-126); only then is the softmax computed without the max shift. (Literals in the
# code: TorchScript reads no module-level numbers.)


def context_layout(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V packed as (T, 2, H, d) (``CrossAttention.project_kv``) -> keys (H, d, T) pre-scaled by
    log2(e) / sqrt(d), values (H, T, d): the operands of ``attend``, laid out once per context."""
    k, v = kv.unbind(1)
    scale = 1.4426950408889634 / math.sqrt(k.shape[-1])  # log2(e) / sqrt(d)
    return (k.permute(1, 2, 0) * scale).contiguous(), v.transpose(0, 1).contiguous()


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(N, H * d) queries -> (N, H * d) attention outputs over one context (``context_layout``'s keys and values;
    an empty context reads zeros)."""
    n, width = q.shape[0], q.shape[1]
    heads = keys.shape[0]
    if keys.shape[-1] == 0:  # the jagged ops' empty-sequence rule
        return q.new_zeros(n, width)
    scores = torch.bmm(q.reshape(n, heads, width // heads).transpose(0, 1), keys)  # (H, N, T), log2 units
    probs = scores.exp2()  # unnormalized; no max shift while no row overflows or underflows (checked)
    sums = probs.sum(-1, keepdim=True)
    if not bool(((sums > 2.0**-60) & (sums < 2.0**100)).all()):
        probs = scores.sub_(scores.amax(-1, keepdim=True)).exp2_()  # the max-shifted softmax, in place
        sums = probs.sum(-1, keepdim=True)
    out = torch.bmm(probs, values).div_(sums)  # (H, N, d)
    return out.transpose(0, 1).reshape(n, width)


class TorchAttention(nn.Module):
    """``attend`` as a module (the one-user path holds one attention module; TorchScript compiles only its own)."""

    def forward(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return attend(q, keys, values)


class FusedAttention(nn.Module):
    """``attend`` by gemflow's C++ op; construct it only after ``models.inference.native.load()`` returned True."""

    def forward(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return torch.ops.gemflow.shared_context_attend(q, keys, values)  # the widest SIMD this CPU has


def attention_module() -> nn.Module:
    """The fused op where it is built on this machine, else PyTorch's ops."""
    from models.inference import native

    return FusedAttention() if native.load() else TorchAttention()


def reference_attend(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """``attend`` in plain PyTorch: SDPA over (1, H, N, d) queries and the (T, 2, H, d) packed K/V."""
    n, width = q.shape
    k, v = kv.unbind(1)
    if k.shape[0] == 0:
        return q.new_zeros(n, width)
    heads = k.shape[1]
    qh = q.view(n, heads, width // heads).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None])[0]
    return out.transpose(0, 1).reshape(n, width)
