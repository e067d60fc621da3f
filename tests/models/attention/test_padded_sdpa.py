"""The padded-SDPA baseline (what the Triton kernels are benchmarked against) equals the reference, fwd + bwd."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.attention import dispatch, padded_sdpa, reference
from tests.models.attention.test_jagged import (
    BF16,
    FP32,
    assert_close,
    bias_r,
    bias_t,
    cross_inputs,
    lengths,
    run_cross,
    run_self,
    self_inputs,
)


def check_self(lens, causal, pos_r, time_t, dtype, seed) -> None:
    inputs = self_inputs(lens, 2, 8, causal, pos_r, time_t, dtype, seed)
    weights = torch.randn(inputs["q"].shape, generator=torch.Generator().manual_seed(seed + 1))
    ref_out, ref_grads = run_self(reference, inputs, weights)
    out, grads = run_self(padded_sdpa, inputs, weights)
    tol = BF16 if dtype == torch.bfloat16 else FP32
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    assert_close(out, ref_out, **tol, what="output")
    for name, grad, ref_grad in zip(["q", "k", "v", "pos_bias", "time_bias"], grads, ref_grads, strict=True):
        if ref_grad is not None:
            assert torch.isfinite(grad).all(), f"grad of {name} is not finite"
            assert_close(grad, ref_grad, **tol, what=f"grad of {name}")


@settings(max_examples=40, deadline=None)
@given(lens=lengths, causal=st.booleans(), pos_r=bias_r, time_t=bias_t, seed=st.integers(0, 2**31 - 1))
def test_self_attention_matches_reference(lens, causal, pos_r, time_t, seed):
    check_self(lens, causal, pos_r, time_t, torch.float32, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_and_length_one_sequences(causal, dtype):
    check_self([0, 1, 5, 0, 1], causal, 3, 4, dtype, seed=7)


@settings(max_examples=30, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 30)), min_size=0, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_cross_attention_matches_reference(pairs, seed):
    inputs = cross_inputs([p[0] for p in pairs], [p[1] for p in pairs], 2, 8, torch.float32, seed)
    weights = torch.randn(inputs["q"].shape, generator=torch.Generator().manual_seed(seed + 1))
    ref_out, ref_grads = run_cross(reference, inputs, weights)
    out, grads = run_cross(padded_sdpa, inputs, weights)
    assert_close(out, ref_out, **FP32, what="output")
    for name, grad, ref_grad in zip("qkv", grads, ref_grads, strict=True):
        assert torch.isfinite(grad).all(), f"grad of {name} is not finite"
        assert_close(grad, ref_grad, **FP32, what=f"grad of {name}")


def test_dispatcher_offers_the_backend():
    inputs = self_inputs([3, 2], 1, 4, True, None, None, torch.float32, 0)
    out = dispatch.jagged_self_attention(**inputs, backend="padded_sdpa")
    assert torch.allclose(out, reference.jagged_self_attention(**inputs), atol=1e-6)
