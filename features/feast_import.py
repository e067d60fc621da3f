"""``import feast`` without typeguard re-compiling Feast's functions, and without PyTorch, at import time.

Feast decorates ~240 functions and methods with typeguard's ``@typechecked``, which parses each one's source,
rewrites it with run-time type checks and compiles it again, at import: ~60% of ``import feast`` (measured on a
2-core Zen 3: 16.7 s -> 7.0 s wall). Every ``gemflow`` command that touches features pays it, so every Airflow
task did, each a fresh process. typeguard's own production mode (``python -O``) turns the decorator into a no-op
("checks aren't meant to be run in production"), but ``-O`` also drops ``assert`` everywhere and recompiles every
cached module; this does the same for typeguard only. Feast is the only package here that uses typeguard.

``import feast`` also imports PyTorch (``feast.torch_wrapper``, for ``OnlineResponse.to_tensor`` and
``RetrievalJob.to_tensor``, which gemflow never calls). A process that needs Feast but not PyTorch paid ~220 MiB
and ~1.7 s for it: the server's ad-table refresh process (501 -> 283 MiB RSS, started and loaded in 4.8 -> 3.1 s on
a 2-core Zen 3) and the pipeline's feature tasks. ``defer_feast_torch_import`` puts a ``feast.torch_wrapper`` in
place whose ``get_torch`` imports PyTorch when first called.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


def _unchecked(target: Any = None, **_options: Any) -> Any:
    """``typeguard.typechecked`` as ``python -O`` makes it: the target unchanged (bare or with options)."""
    return target if target is not None else _unchecked


def skip_typeguard_instrumentation() -> None:
    """Replace ``typeguard.typechecked`` by a pass-through, before Feast binds it (modules already imported keep
    what they bound; nothing to do without typeguard)."""
    try:
        import typeguard
    except ImportError:
        return
    typeguard.typechecked = _unchecked


def _get_torch() -> types.ModuleType:
    """``feast.torch_wrapper.get_torch``, importing PyTorch on the first call instead of at ``import feast``."""
    return importlib.import_module("torch")


def defer_feast_torch_import() -> None:
    """Install the deferred ``feast.torch_wrapper`` before Feast is imported (once Feast is, nothing to do)."""
    if "feast" in sys.modules or "feast.torch_wrapper" in sys.modules:
        return
    wrapper = types.ModuleType("feast.torch_wrapper", "get_torch: PyTorch, imported on first use (gemflow)")
    wrapper.get_torch = _get_torch
    sys.modules["feast.torch_wrapper"] = wrapper
