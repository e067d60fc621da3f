"""Process settings of the serving process, set once before the first request (all of them deliberate).

- intra-op threads: ``scoring.torch_threads`` per scoring worker (default 1). Requests run on
  ``scoring.workers`` threads at once, so the cores go to concurrent requests instead of to the fork/join of
  one small request's matmuls; torch releases the GIL inside its kernels, so the workers really run together.
- glibc malloc: a 1,000-candidate request allocates a few tensors of ~0.5-1.5 MB each. Above glibc's mmap
  threshold every such allocation is a fresh ``mmap`` whose pages fault in again and are zeroed on every request
  (~800 page faults per request measured, ~25% of the scoring CPU time). Raising the mmap and trim thresholds keeps
  those blocks in the heap and reuses them; the process keeps at most ``TRIM_THRESHOLD_BYTES`` of freed heap
  (bounded, not a leak: RSS settles at the working set's high-water mark). No-op where the C library is not glibc.
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

from models.malloc import glibc_mallopt

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_THRESHOLD_BYTES = 64 << 20  # blocks below this come from the heap (glibc's cap is 32 MiB on 64-bit)
TRIM_THRESHOLD_BYTES = 64 << 20  # free heap kept before glibc returns it (a request frees < ~30 MB)


def keep_allocations_in_heap() -> bool:
    """Raise glibc's mmap/trim thresholds (see the module docstring); False where that is not possible."""
    mallopt = glibc_mallopt()
    if mallopt is None:
        return False
    # glibc refuses an mmap threshold above HEAP_MAX/2 (32 MiB on 64-bit); fall back to that cap.
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) or bool(mallopt(M_MMAP_THRESHOLD, 32 << 20))
    return ok and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def configure(torch_threads: int, gil_switch_ms: float = 0.0) -> None:
    """Set the process-wide settings once; worker threads pick the thread count up lazily (and again in
    ``worker_init``). ``gil_switch_ms`` > 0 sets the interpreter's switch interval (see the module docstring)."""
    torch.set_num_threads(torch_threads)
    if gil_switch_ms > 0:
        sys.setswitchinterval(gil_switch_ms / 1e3)
    if not keep_allocations_in_heap():
        log.warning("could not tune malloc (not glibc?): large tensors are mmap-ed per request")


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
