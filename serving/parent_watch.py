"""``when_parent_exits``: a child process of the server that must not outlive it (the ad-table refresh process,
each of ``server_processes``): a parent killed with SIGKILL stops nobody, and an orphan keeps its work going."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

POLL_S = 1.0


def when_parent_exits(then: Callable[[], None]) -> None:
    """Call ``then`` on a daemon thread once this process's parent is gone (it is re-parented: ``getppid`` changes;
    no pid reuse can fool that)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        then()

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
