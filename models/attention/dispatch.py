"""One entry point per attention op; the models call only these.

Backends share the reference signature (``models.attention.reference``):
- ``reference``: pad + mask, plain PyTorch (tests, tiny batches);
- ``jagged``: the CPU fast path that does not pay for padding (``models.attention.jagged``);
- ``padded_sdpa``: pad + one additive mask + ``scaled_dot_product_attention``, the baseline a GPU user would
  write (``models.attention.padded_sdpa``); it pays for padding, the Triton kernels are measured against it;
- ``triton``: GPU kernels (``models.attention.triton``), imported only when chosen, so a machine without
  Triton never imports it.
``auto`` picks ``triton`` for CUDA tensors when Triton is importable, else ``jagged``.

The ``*_packed`` entry points take q, k, v (or k, v) packed along dim 1, as the fused projections produce them
((total, 3, H, D), (total, 2, H, D)): a backend with its own packed op gathers each row once; the others get
the unbound views.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from functools import cache
from typing import Literal

import torch
from torch.profiler import record_function

Backend = Literal["auto", "reference", "jagged", "padded_sdpa", "triton"]
_MODULES = {
    "reference": "models.attention.reference",
    "jagged": "models.attention.jagged",
    "padded_sdpa": "models.attention.padded_sdpa",
    "triton": "models.attention.triton",
}


_BOUNDARIES: list[tuple] = []  # (the function, the one-element list its wrapper calls through)


def compile_boundary(fn):
    """``torch.compiler.disable(fn)``, applied only once something compiles (``stop_compiles_at_boundaries``).

    ``torch.compiler.disable`` imports ``torch._dynamo`` (with sympy, triton and inductor: ~145 MB and ~2 s)
    in every process that imports the models, although only training with ``distributed.compile`` and the
    benchmarks ever compile; the server never does. Until then the wrapper calls ``fn`` itself."""
    target = [fn]
    _BOUNDARIES.append((fn, target))
    if "torch._dynamo" in sys.modules:  # the compiler is loaded already: no reason to wait
        target[0] = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return target[0](*args, **kwargs)

    return call


def stop_compiles_at_boundaries() -> None:
    """Make every ``compile_boundary`` a ``torch.compiler.disable``: a compiled region that calls one stops its
    graph there and runs it eagerly (data-dependent buckets and Python loops). Called before compiling."""
    for fn, target in _BOUNDARIES:
        if target[0] is fn:
            target[0] = torch.compiler.disable(fn)


@cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve(backend: Backend, device: torch.device) -> str:
    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" and _triton_available() else "jagged"


def _op(backend: Backend, device: torch.device, name: str):
    module = importlib.import_module(_MODULES[resolve(backend, device)])
    return getattr(module, name)


# Each call is a profiler span: the step account (models.training.distributed.step_account) books its ops to attention.
@compile_boundary  # data-dependent buckets and Python loops: compiled regions stop at the attention call
def jagged_self_attention(q, k, v, offsets, *, backend: Backend = "auto", **kwargs) -> torch.Tensor:
    with record_function("gemflow.attention"):
        return _op(backend, q.device, "jagged_self_attention")(q, k, v, offsets, **kwargs)


@compile_boundary
def jagged_cross_attention(q, q_offsets, k, v, kv_offsets, *, backend: Backend = "auto") -> torch.Tensor:
    with record_function("gemflow.attention"):
        return _op(backend, q.device, "jagged_cross_attention")(q, q_offsets, k, v, kv_offsets)


@compile_boundary
def jagged_self_attention_packed(qkv, offsets, *, backend: Backend = "auto", **kwargs) -> torch.Tensor:
    """``jagged_self_attention`` on q, k, v packed as (total, 3, H, D)."""
    with record_function("gemflow.attention"):
        module = importlib.import_module(_MODULES[resolve(backend, qkv.device)])
        packed = getattr(module, "jagged_self_attention_packed", None)
        if packed is not None:
            return packed(qkv, offsets, **kwargs)
        return module.jagged_self_attention(*qkv.unbind(1), offsets, **kwargs)


@compile_boundary
def jagged_cross_attention_packed(q, q_offsets, kv, kv_offsets, *, backend: Backend = "auto") -> torch.Tensor:
    """``jagged_cross_attention`` with k, v packed as (total_kv, 2, H, D)."""
    with record_function("gemflow.attention"):
        module = importlib.import_module(_MODULES[resolve(backend, q.device)])
        packed = getattr(module, "jagged_cross_attention_packed", None)
        if packed is not None:
            return packed(q, q_offsets, kv, kv_offsets)
        return module.jagged_cross_attention(q, q_offsets, *kv.unbind(1), kv_offsets)
