"""Linear layers on oneDNN for CPU inference: the GEMM, its bias, a GELU and a residual add in one call.

Why: PyTorch's float32 CPU matmul calls MKL's sgemm, which on an AMD EPYC Zen 5 ran at about half of what oneDNN's
GEMM reaches on the same core (one thread, 1,000 x 64 @ 64 x 128: 93 vs 182 GFLOP/s, 4,000 x 256 @ 256 x 256: 89
vs 204; identical float32 results there). oneDNN also applies the bias, GELU and residual add as
post-ops of the GEMM instead of three more passes over the output. The ranker's per-candidate path (``Ranker.score``
with gradients off) is a chain of such small-K GEMMs, so serving a request costs about half the matmul time.
Not on every CPU: on a Zen 3 EPYC (AVX2) MKL's sgemm reaches ~85 GFLOP/s on the same shapes and the ranker's
candidate path ran 1-7% faster on it. ``models.inference.one_user.script`` therefore times both and keeps the faster.

``linear`` takes the oneDNN path only where it applies and pays: gradients off, float32 CPU tensors, a torch
build with oneDNN, at least ``MIN_ROWS`` rows (below that oneDNN's per-call setup, ~10 us, exceeds the gain).
Everywhere else it runs ``reference_linear``, the plain PyTorch definition (tests compare the two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def min_rows() -> int:  # a function: TorchScript cannot read a module-level int
    return 64  # measured: 7 rows x 64 -> 128 takes 4 us on MKL, 14 us on oneDNN; 1,000 rows 176 vs 90 us


MIN_ROWS = min_rows()


def reference_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``activation(x @ weight^T + bias) (+ residual)`` in plain PyTorch (exact GELU, as ``nn.GELU()``)."""
    y = F.linear(x, weight, bias)
    if activation == "gelu":
        y = F.gelu(y)
    return y if residual is None else residual + y


def _available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):  # a torch build without the mkldnn op namespace
        return False


AVAILABLE = _available()


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # TorchScript skips an `if not is_scripting()` block (it cannot read the global); scripted callers
    # (``models.inference.one_user.script``) are built only where AVAILABLE. Inductor cannot lower the oneDNN op: code that
    # torch.compile traces takes the reference (inductor generates its own GEMM calls).
    if not torch.jit.is_scripting():  # noqa: SIM102
        if not AVAILABLE or torch.compiler.is_compiling():
            return False
    return (
        not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] >= min_rows()
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    use_onednn: bool = True,
) -> torch.Tensor:
    """``activation(x @ weight^T + bias) (+ residual)`` for (N, in) ``x`` and (out, in) ``weight``; ``residual``
    (N, out) only without an activation (it is fused as a sum after the GEMM and its bias). ``use_onednn=False``:
    always the reference (callers that measured PyTorch's own GEMM faster on this CPU, ``models.inference.one_user``)."""
    if activation != "none" and activation != "gelu":  # (no tuple constant: TorchScript reads no globals)
        raise ValueError("activation must be 'none' or 'gelu', got " + activation)
    if residual is not None and activation != "none":
        raise ValueError("a residual add is fused only without an activation")
    if not use_onednn or not applies(x, weight):
        return reference_linear(x, weight, bias, activation, residual)
    x, weight = x.contiguous(), weight.contiguous()
    if residual is not None:
        if torch.jit.is_scripting():  # TorchScript picks the overload from the arguments
            return torch.ops.mkldnn._linear_pointwise(x, residual.contiguous(), weight, bias, "add")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), weight, bias, "add")
    # "none" as the algorithm of the gelu post-op = the exact (erf) GELU
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, activation, [], "none")
