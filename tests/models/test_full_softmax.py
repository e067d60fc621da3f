"""The chunked full softmax equals ``F.cross_entropy(query @ items.T, targets)`` in value and gradients."""

import pytest
import torch
import torch.nn.functional as F

from models.architectures import full_softmax
from models.architectures.full_softmax import full_softmax_loss


@pytest.mark.parametrize("rows, chunk", [(1, 64), (7, 3), (130, 64), (64, 64)])
def test_value_and_gradients_equal_the_unchunked_form(rows, chunk):
    gen = torch.Generator().manual_seed(rows)
    query = torch.randn(rows, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    items = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (rows,), generator=gen)
    weight = torch.randn((), generator=gen, dtype=torch.float64)  # a non-unit incoming gradient

    (weight * full_softmax_loss(query, items, targets, chunk=chunk)).backward()
    got = (query.grad.clone(), items.grad.clone())
    query.grad = items.grad = None
    expected_loss = F.cross_entropy(query @ items.T, targets)
    (weight * expected_loss).backward()

    assert torch.allclose(full_softmax_loss(query, items, targets, chunk=chunk), expected_loss)
    assert torch.allclose(got[0], query.grad) and torch.allclose(got[1], items.grad)


def test_only_the_needed_gradient_is_computed_and_no_grad_is_plain():
    query = torch.randn(5, 4, requires_grad=True)
    items = torch.randn(9, 4)  # frozen items: no item gradient to accumulate
    targets = torch.tensor([0, 1, 2, 3, 8])
    full_softmax_loss(query, items, targets, chunk=2).backward()
    assert query.grad is not None and items.grad is None
    with torch.no_grad():
        assert torch.allclose(
            full_softmax_loss(query, items, targets), F.cross_entropy(query @ items.T, targets)
        )


def test_an_empty_batch_is_a_zero_loss_that_still_backpropagates():
    query = torch.zeros(0, 4, requires_grad=True)
    items = torch.randn(9, 4, requires_grad=True)
    loss = full_softmax_loss(query, items, torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert float(loss) == 0.0 and torch.count_nonzero(items.grad) == 0


@pytest.mark.parametrize("chunk, group", [(64, 1024), (7, 30)])
def test_bf16_gemms_keep_the_loss_and_gradients_close_to_fp32(monkeypatch, chunk, group):
    """bf16 GEMMs, fp32 softmax and accumulators: the loss within 1e-4 of fp32, each gradient within 1% of its
    norm, on cosine-scale logits (unit rows / temperature 0.05, what the user model trains); 150 rows in one
    item-gradient group, or in groups of 28 rows (4 chunks of 7) and a last partial one."""
    monkeypatch.setattr(full_softmax, "LOW_GROUP", group)
    gen = torch.Generator().manual_seed(0)
    query = (F.normalize(torch.randn(150, 32, generator=gen), dim=1) * 20).requires_grad_()
    items = F.normalize(torch.randn(500, 32, generator=gen), dim=1).requires_grad_()
    targets = torch.randint(0, 500, (150,), generator=gen)
    grads = {}
    for dtype in (None, torch.bfloat16):
        loss = full_softmax_loss(query, items, targets, chunk=chunk, gemm_dtype=dtype)
        loss.backward()
        grads[dtype] = (float(loss), query.grad.clone(), items.grad.clone())
        assert query.grad.dtype == items.grad.dtype == torch.float32
        query.grad = items.grad = None
    (loss32, q32, i32), (loss16, q16, i16) = grads[None], grads[torch.bfloat16]
    assert abs(loss16 - loss32) < 1e-4
    assert (q16 - q32).norm() < 0.01 * q32.norm() and (i16 - i32).norm() < 0.01 * i32.norm()
    assert not torch.equal(q16, q32)  # the bf16 path really ran
