"""The daily ingestion's steps, one module per job (``features.ingest`` runs them in order):

- ``raw``: the landed raw partitions (batch landing + the live event path's export), the dates that have one;
- ``offline``: accepted rows and quarantines -> the offline store, and the feature tables derived from it;
- ``online``: ``feast apply``, materialization of the batch views and the recent-events push.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

log = logging.getLogger("features.ingest")


@contextmanager
def step(name: str, timings: dict[str, float]):
    """Log a step of the ingestion and record its duration (seconds) in ``timings[name]``."""
    log.info("ingest: %s ...", name)
    t0 = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - t0, 3)
    log.info("ingest: %s done in %.2fs", name, timings[name])
