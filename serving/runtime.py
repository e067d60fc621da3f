"""Process settings of the serving process, set once before the first request (all of them deliberate).

- intra-op threads: ``scoring.torch_threads`` per scoring worker (default 1). Requests run on
  ``scoring.workers`` threads at once, so the cores go to concurrent requests instead of to the fork/join of
  one small request's matmuls; torch releases the GIL inside its kernels, so the workers really run together.
- glibc malloc: freed memory kept in the heap, up to ``MAX_KEPT_BYTES`` (``gemflow.malloc``, the one memory
  setting of every process that runs the model; bounded, not a leak: RSS settles at the working set's high-water
  mark).
- GIL switch interval: a scoring thread coming back from a torch kernel waits for the GIL until its holder lets
  go, up to the interval (CPython's default 5 ms) when the holder is busy in Python (the event loop parsing the
  next request, a Feast read). A request re-takes the GIL after every kernel, so those waits add up in its tail.
  At 1 ms (``scoring.gil_switch_ms``), open loop 100 req/s x 60 s of 1,000 candidates: p99 48 / 75 ms vs 86 /
  443 ms at 5 ms in alternating runs (``bench/serve.py``), closed-loop throughput unchanged.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import threading
from collections.abc import Callable

import torch

from gemflow.malloc import keep_freed_memory

log = logging.getLogger(__name__)

MAX_KEPT_BYTES = 64 << 20  # free heap kept before glibc returns it (a request frees < ~30 MB)


def configure(torch_threads: int, gil_switch_ms: float = 0.0) -> None:
    """Set the process-wide settings once; worker threads pick the thread count up lazily (and again in
    ``worker_init``). ``gil_switch_ms`` > 0 sets the interpreter's switch interval (see the module docstring)."""
    torch.set_num_threads(torch_threads)
    if gil_switch_ms > 0:
        sys.setswitchinterval(gil_switch_ms / 1e3)
    keep_freed_memory(MAX_KEPT_BYTES)


def worker_init(torch_threads: int) -> None:
    """Initializer of a scoring worker thread: its intra-op thread count, set before its first op."""
    torch.set_num_threads(torch_threads)


def run_on_every_thread(pool: concurrent.futures.Executor, threads: int, fn: Callable[[], None]) -> None:
    """``fn`` once on each of the ``threads`` threads of ``pool``, waiting for all (warm-up: a thread's first
    request grows its malloc arena and faults its pages in; better before serving than in a request). A barrier
    keeps one thread from taking two calls."""
    barrier = threading.Barrier(threads)

    def once() -> None:
        barrier.wait(timeout=120)
        fn()

    for fut in [pool.submit(once) for _ in range(threads)]:
        fut.result()
