"""Attention over one shared context (``models.attention.shared_context``) against SDPA and a float64 softmax."""

from __future__ import annotations

import math

import pytest
import torch

from models.attention.shared_context import attend, context_layout, reference_attend


def _inputs(n: int, t: int, heads: int, head_dim: int, scale: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads * head_dim, generator=g) * scale
    kv = torch.randn(t, 2, heads, head_dim, generator=g)
    return q, kv


def _float64(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    n, width = q.shape
    k, v = kv.double().unbind(1)
    heads = k.shape[1]
    qh = q.double().view(n, heads, width // heads)
    scores = torch.einsum("nhd,thd->hnt", qh, k) / math.sqrt(k.shape[-1])
    out = torch.einsum("hnt,thd->nhd", torch.softmax(scores, -1), v)
    return out.reshape(n, width)


@pytest.mark.parametrize(
    ("n", "t", "heads", "head_dim"),
    [(1000, 66, 4, 16), (1, 1, 1, 8), (7, 3, 2, 32), (300, 130, 8, 8), (64, 66, 1, 64)],
)
def test_matches_sdpa_and_float64(n, t, heads, head_dim):
    q, kv = _inputs(n, t, heads, head_dim)
    got = attend(q, *context_layout(kv))
    torch.testing.assert_close(got, reference_attend(q, kv), rtol=0, atol=2e-6)
    torch.testing.assert_close(got.double(), _float64(q, kv), rtol=0, atol=2e-6)


def test_large_scores_stay_finite():
    """Scores of hundreds (exp would overflow float32 without the max shift) still give the softmax, as close
    to float64 as SDPA is (float32 scores of ~1,000 carry ~1e-4 rounding, in both)."""
    q, kv = _inputs(200, 40, 4, 16, scale=300.0)
    got = attend(q, *context_layout(kv))
    assert torch.isfinite(got).all()
    exact = _float64(q, kv)
    sdpa_error = (reference_attend(q, kv).double() - exact).abs().max()
    assert (got.double() - exact).abs().max() <= 1.5 * sdpa_error


def test_empty_context_reads_zeros():
    q, kv = _inputs(5, 0, 2, 8)
    assert torch.equal(attend(q, *context_layout(kv)), torch.zeros(5, 16))
    assert torch.equal(reference_attend(q, kv), torch.zeros(5, 16))


def test_non_contiguous_queries():
    q, kv = _inputs(50, 10, 2, 8)
    wide = torch.cat([q, q], 1)[:, :16]  # a strided view
    assert not wide.is_contiguous()
    torch.testing.assert_close(attend(wide, *context_layout(kv)), reference_attend(q, kv), rtol=0, atol=2e-6)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_rows_beyond_exp2_range_take_the_shifted_path(sign):
    """Row 3's scores all sit near +-230 (log2 units): unshifted, exp2 overflows or underflows for the whole row.
    It is recomputed with the max subtracted; every row matches float64."""
    q, kv = _inputs(20, 12, 2, 8)
    kv[:, 0, :, 0] += 3.0  # every key leans on channel 0 of each head ...
    q[3, [0, 8]] = sign * 150.0  # ... so row 3's scores are ~ +-150 * 3 / sqrt(8) (x log2 e) for every key
    got = attend(q, *context_layout(kv))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _float64(q, kv), rtol=0, atol=1e-4)
    torch.testing.assert_close(got, reference_attend(q, kv), rtol=0, atol=1e-4)


def test_scripted_matches_eager():
    scripted = torch.jit.script(attend)
    for shift in (0.0, 300.0):
        q, kv = _inputs(100, 20, 4, 8, scale=1.0 + shift)
        torch.testing.assert_close(
            scripted(q, *context_layout(kv)), attend(q, *context_layout(kv)), rtol=0, atol=0
        )
