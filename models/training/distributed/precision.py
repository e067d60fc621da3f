"""The dense tower's precision: bf16 where this machine multiplies bf16 at least as fast as fp32, else fp32.

bf16 halves the bytes of every weight and activation, and where the hardware has bf16 matmul units (GPUs from
Ampere on, Intel AMX, AVX-512 BF16 on AMD Zen 4/5 and recent Xeons) its GEMMs run ~2x faster than fp32. Without
them PyTorch converts in software: on an AMD EPYC Zen 3 (AVX2 only, one thread) a (1024 x 256) @ (256 x 1024)
``F.linear`` runs 5.4 GFLOP/s in bf16 against 55 in fp32, so a bf16 run trains ~10x slower there, for nothing.
``distributed.precision: auto`` (the default) measures that linear in both dtypes on one thread, once per run, in
the launcher (every rank then reads the choice from the run's config); GPUs take bf16 where they support it.
A resumed run keeps the precision its checkpoint was written in (DeepSpeed's bf16 and fp32 states differ).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from models.training.distributed.mfu import best_seconds

log = logging.getLogger(__name__)
PROBE = (1024, 256, 1024)  # tokens, d_model, features: a projection of the tower (~0.1 s in software bf16)


def dtype_of(precision: str) -> torch.dtype:
    """The torch dtype of a resolved precision ("bf16" | "fp32")."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def linear_gflops(dtype: torch.dtype, threads: int = 1) -> float:
    """GFLOP/s of ``F.linear`` on the probe shape in ``dtype``, on ``threads`` intra-op threads."""
    m, k, n = PROBE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return 2 * m * k * n / best_seconds(lambda: F.linear(x, w)) / 1e9
    finally:
        torch.set_num_threads(previous)


def choose(bf16_gflops: float, fp32_gflops: float) -> str:
    """bf16 unless it multiplies slower than fp32 (then it only costs accuracy)."""
    return "bf16" if bf16_gflops >= fp32_gflops else "fp32"


def resolve(
    requested: str, device: torch.device | str = "cpu", what: str = "distributed.precision"
) -> tuple[str, dict[str, float]]:
    """(the precision to run, the GFLOP/s measured to choose it: empty when nothing was measured); ``what``
    names the setting in the log line."""
    if requested != "auto":
        return requested, {}
    if torch.device(device).type == "cuda":
        return ("bf16" if torch.cuda.is_bf16_supported() else "fp32"), {}
    rates = {"bf16": linear_gflops(torch.bfloat16), "fp32": linear_gflops(torch.float32)}
    chosen = choose(rates["bf16"], rates["fp32"])
    log.info("%s=auto: %s (one-thread linear: bf16 %.1f GFLOP/s, fp32 %.1f)",
             what, chosen, rates["bf16"], rates["fp32"])  # fmt: skip
    return chosen, rates
