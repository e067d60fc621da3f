"""Row-bucketed linear layers (``models.inference.row_buckets``): the bucket sizes, and the same values and gradients as
``nn.Linear`` (the plain PyTorch reference) for row counts inside, at and across bucket edges."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.inference.row_buckets import (
    EXACT_BELOW,
    PER_OCTAVE,
    RowBucketedLinear,
    bucket_linear_rows,
    bucket_rows,
)


def test_buckets_cover_every_count_with_little_padding_and_few_sizes():
    sizes = [bucket_rows(m) for m in range(0, 70_000)]
    for m, size in enumerate(sizes):
        assert size >= m
        assert size - m <= m / PER_OCTAVE  # at most 1/32 extra rows
        if m < EXACT_BELOW:
            assert size == m
    assert sizes == sorted(sizes)  # monotone: more rows never get a smaller bucket
    # per power of two, PER_OCTAVE sizes (its last counts round up to the next power)
    for low in (256, 1024, 4096, 32_768):
        assert {s for s in sizes[low : 2 * low]} == set(range(low, 2 * low + 1, low // PER_OCTAVE))
    assert bucket_rows(7_000) == 7_040 and bucket_rows(7_040) == 7_040


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0, 24), (5, 24), (300, 24), (7_041, 24), (3, 97, 24), (1_024, 24)])
def test_values_and_gradients_equal_nn_linear(dtype, shape):
    torch.manual_seed(0)
    plain = nn.Linear(24, 40).to(dtype)
    bucketed = nn.Linear(24, 40).to(dtype)
    bucketed.load_state_dict(plain.state_dict())
    assert bucket_linear_rows(bucketed) == 1 and type(bucketed) is RowBucketedLinear
    x = torch.randn(shape, dtype=dtype)
    grad = torch.randn(*shape[:-1], 40, dtype=dtype)
    outs, grads = [], []
    for layer in (plain, bucketed):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(grad)
        outs.append(out)
        grads.append((xi.grad, layer.weight.grad, layer.bias.grad))
        layer.zero_grad()
    # the weight gradient sums thousands of rows: the GEMM blocks them differently for another row count
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}
    assert outs[1].shape == outs[0].shape and outs[1].dtype == dtype
    torch.testing.assert_close(outs[1], outs[0], **tol)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, **tol)


def test_padded_rows_give_no_gradient():
    """A bucket's zero rows: the weight and bias gradients are those of the real rows alone (fp32, exact sums)."""
    torch.manual_seed(1)
    layer = nn.Linear(8, 4)
    bucket_linear_rows(layer)
    x = torch.randn(300, 8, dtype=torch.float64)  # 300 rows -> a bucket of 304
    layer.double()
    layer(x).sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((4,), 300.0, dtype=torch.float64))
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(4, 8))


def test_only_plain_linears_are_swapped_and_the_state_dict_is_unchanged():
    class Special(nn.Linear):  # e.g. an FP8 linear: its own forward stays
        pass

    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), Special(8, 8), nn.Sequential(nn.Linear(8, 2)))
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    assert bucket_linear_rows(model) == 2
    kinds = [type(m) for m in (model[0], model[2], model[3][0])]
    assert kinds == [RowBucketedLinear, Special, RowBucketedLinear]
    assert model.state_dict().keys() == keys.keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, keys[k])
    assert bucket_linear_rows(model) == 0  # already swapped: nothing left to do
