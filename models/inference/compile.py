"""``torch.compile`` of the dense per-token work, with a clean fallback to eager.

What gets compiled: every module that lists method names in a ``COMPILABLE`` class attribute (the transformer
and target-aware blocks' halves around the attention call, the user model's head). Each region is a few
norms, projections, residual adds and an activation over (tokens, d) rows: inductor fuses the elementwise
work (LayerNorm, bias, GELU, residual, dropout, dtype casts) into a few C++ loops around the GEMMs (which stay
oneDNN/BLAS calls), in forward and backward. The jagged attention between the regions stays eager
(``models.attention.dispatch``'s entry points are compile boundaries, ``torch.compiler.disable`` once
``compile_dense`` runs: their buckets and loops depend on the data).

Regions are compiled with dynamic shapes: the token count changes every step, and one graph must serve them
all (a recompile per step would cost more than it saves). Instances of one class share the compiled code
(modules are inlined: their parameters are graph inputs), so L blocks compile once.

Measured on a 2-core AMD EPYC (Zen 5, AVX-512 BF16, no AMX), heavily shared (load ~8), bf16, 1 thread: the dense
tower alone (``bench/compile_tower.py``, alternating steps, CPU time per step) 1.11x, 0.95x and 1.02x at d_model
256 in three runs, 1.06x at 512: no gain beyond the noise (the regions are GEMM-bound; the non-GEMM time sits in
the eager attention and its bias gradients); whole
training steps (``bench/train.py``) no measurable gain (CPU tokens/s 0.84-0.89x at d 256, 0.92-1.00x at 512), and each new
token-count range (inductor guards such as ``4097 <= tokens``, e.g. an epoch's short last step) recompiles once.
So the default stays ``off``; a cold compile of all regions takes ~70 s there, ~13 s from the cache.

Modes (``distributed.compile``): ``off``; ``on`` (compile, errors surface); ``auto`` (``probe`` compiles a tiny
LayerNorm + Linear + GELU forward and backward first; when that fails, e.g. no C++ compiler for inductor, one
warning line and everything stays eager). Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``, default the repo's
``.cache/inductor``) keeps compiled kernels between runs, so only the first run pays the full compile.
"""

from __future__ import annotations

import logging
import os
import time
from functools import cache
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("gemflow.compile")
CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache" / "inductor"  # gitignored (.cache/)
_compile_seconds = [0.0]  # wall seconds of the probe (the regions' own compile: compile_seconds())


def use_cache_dir() -> str:
    """Point inductor's on-disk cache at the repo's ``.cache/inductor`` unless the caller chose one."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR))
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


@cache
def probe() -> str | None:
    """None when inductor can compile and run a small fused block (forward + backward) here, else why not."""
    use_cache_dir()
    start = time.perf_counter()
    try:
        block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        fn = torch.compile(block, dynamic=True)
        x = torch.randn(5, 16, requires_grad=True)
        y = fn(x)
        y.sum().backward()
        ref = block(x.detach())
        if not torch.allclose(y.detach(), ref, atol=1e-4, rtol=1e-4):
            return "the compiled probe disagrees with eager"
        return None
    except Exception as err:  # any failure to build or run means: stay eager
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    finally:
        _compile_seconds[0] += time.perf_counter() - start


def compile_dense(model: nn.Module, mode: str) -> list[str]:
    """Compile the ``COMPILABLE`` methods of ``model``'s modules in place (state dict unchanged); returns the
    names of the compiled regions ("" entries never). ``mode``: "off" | "on" | "auto" (see the module doc)."""
    if mode == "off":
        return []
    if mode not in ("on", "auto"):
        raise ValueError(f"compile mode must be 'off', 'on' or 'auto', got {mode!r}")
    use_cache_dir()
    if mode == "auto":
        why = probe()
        if why is not None:
            log.warning("torch.compile unavailable (%s): the dense tower runs eager", why)
            return []
    from models.attention.dispatch import stop_compiles_at_boundaries

    stop_compiles_at_boundaries()
    compiled = []
    for name, module in model.named_modules():
        for method in getattr(type(module), "COMPILABLE", ()):
            if method == "finish" and not _plain_ffn(module):
                continue  # MoE FFNs (DeepSpeed all-to-all, capacity routing) are not traceable
            # an instance attribute shadows the method: the module's parameters and state dict are untouched
            setattr(module, method, torch.compile(getattr(module, method), dynamic=True))
            compiled.append(f"{name or type(module).__name__}.{method}")
    return compiled


def is_compiled(module: nn.Module, method: str) -> bool:
    return method in vars(module)


def _plain_ffn(module: nn.Module) -> bool:
    from models.architectures.layers import FeedForward

    ffn = getattr(module, "ffn", None)
    return ffn is None or isinstance(ffn, FeedForward)


def compile_seconds() -> float:
    """Wall seconds this process spent compiling (dynamo + inductor, every region and the probe)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics

        return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))
    except ImportError:  # private API, absent in some torch version: the probe's wall time only
        return _compile_seconds[0]
