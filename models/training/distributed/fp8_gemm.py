"""The float8 GEMM, and on CPU the faster of the real one and an emulation, chosen once per process (or run).

``torch._scaled_mm`` on CPU depends on the vendor by four orders of magnitude: 0.03 GFLOP/s on an Intel Xeon
with AMX against 394 for a bf16 matmul of the same shape, 0.1-0.4x bf16 on an AMD EPYC. The emulation reads the
same float8 operands and scales and multiplies them in bf16: every e4m3 / e5m2 value is exact in bf16, the
matmul accumulates in fp32, and the scales are applied to its output (one extra bf16 rounding, <= 2^-9 relative).
So the recipe's numerics (which tensors are cast, how they are scaled) stay those of float8 training; only
the GEMM's speed changes. GPUs always run ``torch._scaled_mm``.

Convention of ``torch._scaled_mm``: ``scale_a`` / ``scale_b`` dequantize (``a = a8 * scale_a``); a scale is a
scalar (tensorwise) or (M, 1) / (1, N) (rowwise).
"""

from __future__ import annotations

import logging

import torch

from models.training.distributed.config import FP8_CPU_GEMMS as CPU_GEMMS  # "auto", "scaled_mm", "emulated"
from models.training.distributed.mfu import best_seconds

log = logging.getLogger(__name__)
PROBE = (256, 256, 256)  # M, K, N: ~1 s of _scaled_mm on the slowest CPU seen, milliseconds elsewhere

_measured: dict[str, float] | None = None  # GFLOP/s of the probe shape, measured once per process
_path: str | None = None  # this process's CPU path: "scaled_mm" | "emulated"


def scaled_mm_reference(a8, b8, scale_a, scale_b, out_dtype, bias=None) -> torch.Tensor:
    """Plain PyTorch: dequantize to fp32, multiply, add the bias, cast once."""
    y = (a8.float() * scale_a) @ (b8.float() * scale_b)
    return (y if bias is None else y + bias.float()).to(out_dtype)


def emulated_scaled_mm(a8, b8, scale_a, scale_b, out_dtype, bias=None) -> torch.Tensor:
    """The float8 GEMM as a bf16 matmul of the float8 values (exact in bf16), scaled afterwards."""
    y = torch.mm(a8.to(torch.bfloat16), b8.to(torch.bfloat16)).float()
    y = y.mul_(scale_a).mul_(scale_b)
    return (y if bias is None else y.add_(bias)).to(out_dtype)


def scaled_mm(a8, b8, scale_a, scale_b, out_dtype, bias=None) -> torch.Tensor:
    """``torch._scaled_mm`` where it is fast (GPUs; CPUs where it measured faster), else the emulation."""
    if a8.device.type == "cpu" and cpu_gemm() == "emulated":
        return emulated_scaled_mm(a8, b8, scale_a, scale_b, out_dtype, bias)
    return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)


# ----------------------------------------------------------------------------------------------- the choice
def measure() -> dict[str, float]:
    """GFLOP/s of a bf16 matmul, ``torch._scaled_mm`` and the emulation on the probe shape, at this process's
    threads; measured once per process (a few ms here, ~1 s where ``_scaled_mm`` is the slow one)."""
    global _measured
    if _measured is None:
        m, k, n = PROBE
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        # b column-major, as _scaled_mm wants
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0)
        a16, b16 = a.bfloat16(), b.bfloat16().t()
        secs = {
            "bf16": best_seconds(lambda: torch.mm(a16, b16)),
            "emulated": best_seconds(lambda: emulated_scaled_mm(a8, b8, one, one, torch.bfloat16)),
        }
        real = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        secs["scaled_mm"] = best_seconds(real, give_up=20 * secs["emulated"])  # a cliff needs no second look
        _measured = {name: 2 * m * k * n / s / 1e9 for name, s in secs.items()}
    return _measured


def figures() -> dict[str, float] | None:
    """What ``measure`` found in this process (None when the path was forced or adopted)."""
    return _measured


def use_cpu_gemm(mode: str = "auto") -> str:
    """Set this process's CPU float8 GEMM: ``scaled_mm``, ``emulated``, or ``auto`` (the faster one on the
    probe). Logs the choice, with the figures when measured; returns the path."""
    global _path
    if mode not in CPU_GEMMS:
        raise ValueError(f"distributed.fp8.cpu_gemm must be one of {CPU_GEMMS}, got {mode!r}")
    if mode == "auto":
        g = measure()
        _path = "scaled_mm" if g["scaled_mm"] >= g["emulated"] else "emulated"
        log.info("float8 GEMM on CPU: %s (torch._scaled_mm %.2f GFLOP/s = %.3gx bf16 %.1f; emulated %.1f = %.2fx)",
                 _path, g["scaled_mm"], g["scaled_mm"] / g["bf16"], g["bf16"], g["emulated"],
                 g["emulated"] / g["bf16"])  # fmt: skip
    else:
        _path = mode
        log.info("float8 GEMM on CPU: %s (forced by distributed.fp8.cpu_gemm)", mode)
    return _path


def set_cpu_gemm(path: str) -> None:
    """Adopt a path decided elsewhere (rank 0's, so that all ranks compute alike), silently."""
    global _path
    if path not in CPU_GEMMS[1:]:
        raise ValueError(f"a CPU float8 GEMM path is one of {CPU_GEMMS[1:]}, got {path!r}")
    _path = path


def cpu_gemm() -> str:
    """This process's CPU path, measuring on first use when nobody chose."""
    return _path or use_cpu_gemm("auto")


# ----------------------------------------------------------------------------------------------- torchao
def route_torchao_gemm() -> bool:
    """Send torchao float8's GEMM through ``scaled_mm``'s CPU choice. torchao's mm / addmm on float8 tensors
    call ``float8_ops.addmm_float8_unwrapped`` (its scales quantize: ``a8 = a * a_scale``); we wrap that one
    function. Idempotent; on a torchao without it, warns and leaves torchao's own GEMM (slow on some CPUs)."""
    from torchao.float8 import float8_ops

    real = getattr(float8_ops, "addmm_float8_unwrapped", None)
    if real is None:
        log.warning("torchao %s has no float8_ops.addmm_float8_unwrapped: float8 GEMMs stay torch._scaled_mm",
                    getattr(__import__("torchao"), "__version__", "?"))  # fmt: skip
        return False
    if getattr(real, "routed_by_gemflow", False):
        return True

    def gemm(
        a_data, a_scale, b_data, b_scale, output_dtype, output_scale=None, bias=None, use_fast_accum=False
    ):
        if a_data.device.type == "cpu" and output_scale is None and cpu_gemm() == "emulated":
            return emulated_scaled_mm(
                a_data, b_data, a_scale.reciprocal(), b_scale.reciprocal(), output_dtype, bias
            )
        return real(a_data, a_scale, b_data, b_scale, output_dtype, output_scale=output_scale, bias=bias,
                    use_fast_accum=use_fast_accum)  # fmt: skip

    gemm.routed_by_gemflow = True
    float8_ops.addmm_float8_unwrapped = gemm
    return True
