"""What the server's child processes (the ad-table refresh process, scoring processes) inherit, and how a dead one's
restarts are paced.

``clean_environ``: a spawned child inherits the parent's environment at the moment it starts. Variables there may
point at a parent's temporary state: Feast, when imported, sets ``PROMETHEUS_MULTIPROC_DIR`` to a folder of its own
(``feast.metrics``), and a server started by a process that imported Feast (``make demo``'s launcher, a DAG task)
inherits that folder, which its owner deletes when it exits. A refresh child started after that failed to import
Feast, every time. Children start without those variables (unless this server shares its metrics with other server
processes on purpose, ``serving.stats.multiprocess``): Feast in the child makes a folder of its own.

``Backoff``: a child that dies is restarted at once, then after 1 s, 2, 4, ... up to 60 s while it keeps dying; a
quiet spell (no death for ``reset_after_s``) or a success (``reset``) starts over.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from serving.stats import multiprocess

# variables that name a parent's temporary folders: metrics files (prometheus_client reads either name)
PARENT_STATE = ("PROMETHEUS_MULTIPROC_DIR", "PROMETHEUS_MULTIPROCESS_DIR")
_SPAWNING = threading.Lock()  # one child started at a time: os.environ is the process's, not the thread's


@contextlib.contextmanager
def clean_environ():
    """Start children inside this block: ``os.environ`` lacks ``PARENT_STATE`` while it runs (restored after)."""
    with _SPAWNING:
        keep = multiprocess()  # server processes sharing their metrics: the supervisor's folder, on purpose
        saved = {} if keep else {k: os.environ.pop(k) for k in PARENT_STATE if k in os.environ}
        try:
            yield
        finally:
            os.environ.update(saved)


class Backoff:
    def __init__(self, first_s: float = 1.0, max_s: float = 60.0, reset_after_s: float = 300.0):
        self.first_s, self.max_s, self.reset_after_s = first_s, max_s, reset_after_s
        self._delay: float | None = None  # None: no death since the last reset
        self._last = -float("inf")

    def next_delay(self) -> float:
        """The wait before restarting a child that just died."""
        now = time.monotonic()
        if self._delay is None or now - self._last > self.reset_after_s:
            self._delay = 0.0
        else:
            self._delay = min(max(2 * self._delay, self.first_s), self.max_s)
        self._last = now
        return self._delay

    def reset(self) -> None:
        self._delay = None
