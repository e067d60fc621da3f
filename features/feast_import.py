"""``import feast`` without typeguard re-compiling Feast's functions at import time.

Feast decorates ~240 functions and methods with typeguard's ``@typechecked``, which parses each one's source,
rewrites it with run-time type checks and compiles it again, at import: ~60% of ``import feast`` (measured on a
2-core Zen 3: 16.7 s -> 7.0 s wall). Every ``gemflow`` command that touches features pays it, so every Airflow
task did, each a fresh process. typeguard's own production mode (``python -O``) turns the decorator into a no-op
("checks aren't meant to be run in production"), but ``-O`` also drops ``assert`` everywhere and recompiles every
cached module; this does the same for typeguard only. Feast is the only package here that uses typeguard.
"""

from __future__ import annotations

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
