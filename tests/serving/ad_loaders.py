"""Loaders the ``ProcessLoader`` tests run in a child process (module-level: spawn pickles them by name; this
module imports nothing heavy, so the child starts fast)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from serving.ad_table import AdSnapshot, Loader


def pid_loader() -> Loader:
    """Each snapshot holds one ad whose ``pid`` column says which process built it."""
    return lambda: AdSnapshot.from_rows(np.array([1]), {"pid": np.array([os.getpid()])}, None)


def unreachable_store() -> Loader:
    raise ConnectionError("feature store unreachable")


def dies_once(marker: Path) -> Loader:
    """The first refresh kills its process (as an OOM kill would); later ones build normally."""

    def load() -> AdSnapshot:
        if not marker.exists():
            marker.touch()
            os._exit(1)
        return pid_loader()()

    return load


def counts_builds(log: Path) -> Loader:
    """``pid_loader``, appending a line to ``log`` each time a loader is built."""
    with log.open("a") as f:
        f.write(f"{os.getpid()}\n")
    return pid_loader()


def slow_build(seconds: float) -> Loader:
    """A loader whose construction takes ``seconds`` (a store that answers slowly at start-up)."""
    import time

    time.sleep(seconds)
    return pid_loader()


def imports_feast() -> Loader:
    """``pid_loader`` after importing Feast's metrics module (which fails where the metrics folder is gone)."""
    import feast.metrics  # noqa: F401

    return pid_loader()


def always_dies() -> Loader:
    """Every refresh kills its process (a child in a crash loop)."""

    def load() -> AdSnapshot:
        os._exit(1)

    return load
