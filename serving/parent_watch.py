"""``when_parent_exits``: a child process of the server that must not outlive it (the ad-table refresh process,
each of ``server_processes``): a parent killed with SIGKILL stops nobody, and an orphan keeps its work going."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

POLL_S = 1.0


def when_parent_exits(then: Callable[[], None], parent: int) -> None:
    """Call ``then`` on a daemon thread once this process's parent, pid ``parent``, is gone (it is re-parented:
    ``getppid`` changes; no pid reuse can fool that). ``parent`` comes from the parent itself (``os.getpid()`` it
    passed at spawn): a spawned child imports for seconds before it can start watching, and a parent that died in
    that time would otherwise look like the parent it has now (init), never to exit; such a child calls ``then`` at
    once."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        then()

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
