"""The oneDNN linear path against its plain PyTorch reference (``models.inference.onednn``)."""

from __future__ import annotations

import pytest
import torch

from models.inference import onednn


@pytest.mark.parametrize("rows", [1, onednn.MIN_ROWS - 1, onednn.MIN_ROWS, 1000])
@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_the_reference(rows, activation, with_bias):
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 64, generator=g), torch.randn(128, 64, generator=g) / 8
    bias = torch.randn(128, generator=g) if with_bias else None
    with torch.inference_mode():
        fast = onednn.linear(x, weight, bias, activation)
        ref = onednn.reference_linear(x, weight, bias, activation)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [8, 1000])
def test_residual_add_is_fused_after_the_bias(rows):
    g = torch.Generator().manual_seed(1)
    x, weight, bias = (
        torch.randn(rows, 128, generator=g),
        torch.randn(64, 128, generator=g) / 11,
        torch.randn(64),
    )
    residual = torch.randn(rows, 64, generator=g)
    with torch.inference_mode():
        fast = onednn.linear(x, weight, bias, residual=residual)
    torch.testing.assert_close(fast, residual + x @ weight.T + bias, rtol=1e-5, atol=1e-5)


def test_the_fast_path_is_taken_only_where_it_applies():
    x, weight = torch.randn(1000, 64), torch.randn(32, 64)
    with torch.inference_mode():
        assert onednn.applies(x, weight) == onednn.AVAILABLE
        assert not onednn.applies(x[:8], weight)  # too few rows to pay for oneDNN's setup
        assert not onednn.applies(x.double(), weight.double())
    assert not onednn.applies(x, weight)  # gradients on: training keeps autograd's F.linear
    w = weight.clone().requires_grad_()
    onednn.linear(x, w).sum().backward()
    assert w.grad is not None


def test_on_this_machine_the_kernel_is_oneDNN():
    # the CI machines are x86 Linux with the stock torch wheel: losing oneDNN would silently halve serving speed
    assert onednn.AVAILABLE


def test_bad_arguments_are_named():
    x, weight = torch.randn(100, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match="activation"):
        onednn.linear(x, weight, activation="relu")
    with pytest.raises(ValueError, match="residual"):
        onednn.linear(x, weight, activation="gelu", residual=torch.zeros(100, 3))


@pytest.mark.parametrize("rows", [8, 1000])
def test_scripted_linear_equals_eager(rows):
    """``models.inference.one_user`` calls ``linear`` from TorchScript: the same overloads, the same results."""
    scripted = torch.jit.script(onednn.linear)
    g = torch.Generator().manual_seed(rows)
    x, weight, bias = torch.randn(rows, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(32)
    residual = torch.randn(rows, 32, generator=g)
    with torch.inference_mode():
        for act, res in (("none", None), ("gelu", None), ("none", residual)):
            torch.testing.assert_close(
                scripted(x, weight, bias, act, res), onednn.linear(x, weight, bias, act, res), rtol=0, atol=0
            )


def test_code_traced_by_torch_compile_takes_the_reference():
    """Inductor cannot lower the oneDNN op: while dynamo traces, ``linear`` is the plain PyTorch one."""
    x, weight, bias = torch.randn(200, 64), torch.randn(32, 64), torch.randn(32)
    compiled = torch.compile(onednn.linear, backend="eager", fullgraph=True)
    with torch.inference_mode():
        torch.testing.assert_close(
            compiled(x, weight, bias, "gelu"), onednn.reference_linear(x, weight, bias, "gelu")
        )


def test_use_onednn_false_is_the_reference():
    """``models.inference.one_user`` turns oneDNN off where PyTorch's own GEMMs measured faster: then it is the reference."""
    g = torch.Generator().manual_seed(3)
    x, weight, bias = torch.randn(1000, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(32)
    residual = torch.randn(1000, 32, generator=g)
    with torch.inference_mode():
        for act, res in (("none", None), ("gelu", None), ("none", residual)):
            torch.testing.assert_close(
                onednn.linear(x, weight, bias, act, res, use_onednn=False),
                onednn.reference_linear(x, weight, bias, act, res),
                rtol=0,
                atol=0,
            )
