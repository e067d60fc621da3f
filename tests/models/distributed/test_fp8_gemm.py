"""The float8 GEMM on CPU: torch._scaled_mm and its bf16 emulation agree with the plain reference and with each
other (forward and backward, through torchao and through the torchao-free Linear), and either can be forced."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models.training.distributed import fp8_gemm
from models.training.distributed.config import Float8Config
from models.training.distributed.fp8 import convert_to_float8, convert_to_scaled_mm, float8_filter
from models.training.distributed.fp8_gemm import (
    emulated_scaled_mm,
    scaled_mm_reference,
    set_cpu_gemm,
    use_cpu_gemm,
)

PATHS = ("scaled_mm", "emulated")


@pytest.fixture(autouse=True)
def _restore_the_choice():
    """The choice is per process: leave it as the test found it."""
    saved = fp8_gemm._path
    yield
    fp8_gemm._path = saved


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _operands(m, k, n, dtype, rowwise, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a8 = (torch.randn(m, k, generator=gen) * 4).to(dtype)
    b8 = (torch.randn(n, k, generator=gen) * 4).to(dtype).t()  # column-major, as _scaled_mm wants
    if rowwise:
        sa, sb = torch.rand(m, 1, generator=gen) + 0.5, torch.rand(1, n, generator=gen) + 0.5
    else:
        sa, sb = torch.tensor(0.37), torch.tensor(2.5)
    return a8, b8, sa, sb


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])  # forward, gradients
def test_both_gemms_match_the_reference(dtype, rowwise):
    a8, b8, sa, sb = _operands(48, 64, 32, dtype, rowwise)
    bias = torch.randn(32).to(torch.bfloat16)
    want = scaled_mm_reference(a8, b8, sa, sb, torch.float32, bias)
    emulated = emulated_scaled_mm(a8, b8, sa, sb, torch.bfloat16, bias)
    real = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16)
    assert emulated.dtype == real.dtype == torch.bfloat16 and emulated.shape == real.shape == (48, 32)
    # the bf16 output rounding is the only difference: ~2^-9 relative each, a little more for the emulation
    assert rel(real, want) < 5e-3
    assert rel(emulated, want) < 5e-3
    assert rel(emulated, real) < 5e-3


class _FFN(nn.Module):
    """Linears at a module path the float8 filter converts (the ``ffn`` group)."""

    def __init__(self, *dims: int):
        super().__init__()
        self.ffn = nn.Module()
        layers = [nn.Linear(i, o) for i, o in zip(dims[:-1], dims[1:], strict=False)]
        self.ffn.net = nn.Sequential(*[m for lin in layers for m in (lin, nn.GELU())][:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn.net(x)


def _forward_backward(model: nn.Module, x: torch.Tensor, path: str | None):
    """Output, gradients (input, first weight, last bias) and the ops that ran, on ``path``. The upstream
    gradient is fixed, so that every GEMM of both paths reads the same float8 operands."""
    if path:
        set_cpu_gemm(path)
    x = x.clone().requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = model(x)
        upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        (y.float() * upstream).sum().backward()
    net = model.ffn.net
    got = [y.detach(), x.grad, net[0].weight.grad, net[-1].bias.grad]
    return got, {e.key for e in prof.key_averages()}


def _convert(model: nn.Module, recipe: str) -> list[str]:
    if recipe == "torchao-free":  # the torch-only Linear (tensorwise through fp8_gemm.scaled_mm)
        return convert_to_scaled_mm(model, float8_filter(Float8Config(recipe="tensorwise", min_features=16)))
    return convert_to_float8(model, Float8Config(recipe=recipe, min_features=16))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "torchao-free"])
def test_one_float8_linear_is_the_same_on_both_paths(recipe):
    """Forward and backward of one float8 Linear: the emulation equals _scaled_mm up to bf16 rounding."""
    torch.manual_seed(0)
    base = _FFN(64, 128).to(torch.bfloat16)
    x = torch.randn(37, 64, dtype=torch.bfloat16)  # 37 rows: not a multiple of the 16-row tile
    results = {}
    for path in PATHS:
        model = copy.deepcopy(base)
        assert _convert(model, recipe) == ["ffn.net.0"]
        results[path] = _forward_backward(model, x, path)
    assert "aten::_scaled_mm" in results["scaled_mm"][1]
    assert "aten::_scaled_mm" not in results["emulated"][1]  # the emulation never calls the slow kernel
    for got, want in zip(results["emulated"][0], results["scaled_mm"][0], strict=True):
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert rel(got, want) < 1e-2


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "torchao-free"])
def test_a_float8_mlp_trains_close_to_bf16_on_both_paths(recipe):
    """Stacked float8 Linears re-quantize what the layer below computed, so the two paths drift apart by float8
    rounding (not bf16's); each stays as close to the bf16 model as float8 training does."""
    torch.manual_seed(0)
    base = _FFN(64, 128, 32).to(torch.bfloat16)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    want, _ = _forward_backward(base, x, None)
    for path in PATHS:
        model = copy.deepcopy(base)
        assert _convert(model, recipe) == ["ffn.net.0", "ffn.net.2"]
        got, _ = _forward_backward(model, x, path)
        for g, w in zip(got, want, strict=True):
            assert rel(g, w) < 0.15, path  # ~0.05-0.09 measured, on both paths


def test_the_path_can_be_forced_and_auto_takes_the_faster():
    assert use_cpu_gemm("emulated") == "emulated" == fp8_gemm.cpu_gemm()
    assert use_cpu_gemm("scaled_mm") == "scaled_mm" == fp8_gemm.cpu_gemm()
    chosen = use_cpu_gemm("auto")
    g = fp8_gemm.figures()
    assert set(g) == {"bf16", "scaled_mm", "emulated"} and all(v > 0 for v in g.values())
    assert chosen == ("scaled_mm" if g["scaled_mm"] >= g["emulated"] else "emulated")
    assert fp8_gemm.measure() is g  # measured once per process
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        use_cpu_gemm("fast")
    with pytest.raises(ValueError, match="one of"):
        set_cpu_gemm("auto")
