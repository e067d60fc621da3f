"""FastDropout: drops p of the elements (p rounded to 1/256), keeps the expectation, nothing in eval."""

from __future__ import annotations

import pytest
import torch

from models.architectures.fast_dropout import FastDropout, fast_dropout


@pytest.mark.parametrize("p", [0.5, 0.2])
def test_drop_rate_and_expectation(p):
    torch.manual_seed(0)
    x = torch.ones(1_000_000, requires_grad=True)
    y = fast_dropout(x, p)
    dropped = (y == 0).float().mean().item()
    assert dropped == pytest.approx(round(p * 256) / 256, abs=0.003)
    assert y.mean().item() == pytest.approx(1.0, abs=0.01)
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # the gradient goes through the kept elements, scaled alike


def test_eval_and_zero_rate_are_identity_and_bad_rates_are_refused():
    x = torch.randn(4, 7)
    layer = FastDropout(0.5).eval()
    assert torch.equal(layer(x), x) and torch.equal(fast_dropout(x, 0.0), x)
    with pytest.raises(ValueError, match="dropout must be in"):
        FastDropout(1.0)
