"""The one-pass-backward L2 normalisation against its reference, ``F.normalize`` (forward and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.architectures.l2_normalize import l2_normalize


def _rows(dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=gen, dtype=dtype) * torch.logspace(-3, 2, 64, dtype=dtype)[:, None]
    x[5] = 0.0  # a zero row: the clamped norm
    x[6] = 1e-14  # below eps: clamped too
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_gradient_match_f_normalize(dtype):
    x = _rows(dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, ref = l2_normalize(a), F.normalize(b, dim=-1)
    (ours * g).sum().backward()
    (ref * g).sum().backward()
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=tol)
    # a clamped row's gradient is g / eps, as F.normalize's
    torch.testing.assert_close(a.grad[5], g[5] / 1e-12)


def test_gradcheck_and_a_loss_through_cosines():
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(l2_normalize, (x,))
    q, k = torch.randn(9, 16, requires_grad=True), torch.randn(9, 16, requires_grad=True)
    loss = (l2_normalize(q) * l2_normalize(k)).sum(-1).logsumexp(0)
    ref = (F.normalize(q, dim=-1) * F.normalize(k, dim=-1)).sum(-1).logsumexp(0)
    ours_grads = torch.autograd.grad(loss, (q, k))
    ref_grads = torch.autograd.grad(ref, (q, k))
    for a, b in zip(ours_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_without_grad_it_is_f_normalize():
    x = _rows()
    with torch.no_grad():
        assert torch.equal(l2_normalize(x.requires_grad_()), F.normalize(x, dim=-1))
