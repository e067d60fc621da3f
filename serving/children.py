"""What the server's child processes (the ad-table refresh process, scoring processes) inherit. (How a dead one's
restarts are paced, and how a child stops with its parent, is ``gemflow.processes``: ``Backoff``, ``when_gone``.)

``clean_environ``: a spawned child inherits the parent's environment at the moment it starts. Variables there may
point at a parent's temporary state: Feast, when imported, sets ``PROMETHEUS_MULTIPROC_DIR`` to a folder of its own
(``feast.metrics``), and a server started by a process that imported Feast (``make demo``'s launcher, a DAG task)
inherits that folder, which its owner deletes when it exits. A refresh child started after that failed to import
Feast, every time. Children start without those variables (unless this server shares its metrics with other server
processes on purpose, ``serving.stats.multiprocess``): Feast in the child makes a folder of its own.
"""

from __future__ import annotations

import contextlib
import os
import threading

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
