"""Stop-the-world pauses of the serving process: the latency that no request's own work explains.

- Garbage collection: a full (generation-2) collection walks every tracked object of the process while holding
  the GIL. With torch, Feast, MLflow, KServe and the model loaded that is ~5e5 objects, 0.3-0.6 s during which
  no request progresses (measured). ``freeze_heap`` (called once, after the model is loaded and warmed up) moves
  everything alive into the permanent generation, so later collections walk only what requests allocated since.
- Event-loop lag: how late a periodic timer fires on the asyncio loop, i.e. how long a request that has just
  arrived waits before the loop even reads it (GIL held elsewhere, a collection, a blocking call).

Both are reported in ``GET /v2/models/{name}/stats`` (``pauses``) so a load test can tell queueing from stalls.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import threading
import time

import numpy as np

# The probe timer's period. Each wake of an idle server costs ~0.14 ms of CPU here (measured: 14 ms/s idle at
# 10 ms), which at 100 req/s was ~0.14 ms per request; at 50 ms a stall of 50 ms or more is still always seen.
LAG_INTERVAL_S = 0.05
LAG_WINDOW_S = 60.0  # lag samples kept: the last minute
GENERATIONS = (0, 1, 2)  # the collector's generations (gc.callbacks' info["generation"])


def freeze_heap() -> int:
    """Collect once, then exempt every object alive now from future collections; returns how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class PauseMonitor:
    """GC pauses per generation (via ``gc.callbacks``) and event-loop lag (a timer task on the loop)."""

    def __init__(self, lag_interval_s: float = LAG_INTERVAL_S) -> None:
        self.lag_interval_s = lag_interval_s
        # Reentrant: a collection can start on a thread that holds it (any allocation in ``snapshot``), and its
        # callback takes it again; a plain Lock deadlocked that thread, the event loop (CI, GET .../stats).
        self._lock = threading.RLock()
        self._gc_started: dict[int, float] = {}  # thread id -> start of the collection it runs
        # one entry per generation from the start: a nested callback changes values, never the keys iterated
        self.gc_count = collections.Counter({g: 0 for g in GENERATIONS})
        self.gc_total_ms = collections.Counter({g: 0.0 for g in GENERATIONS})
        self.gc_max_ms: dict[int, float] = {g: 0.0 for g in GENERATIONS}
        self.lags_ms: collections.deque[float] = collections.deque(maxlen=int(LAG_WINDOW_S / lag_interval_s))
        self._task: asyncio.Task | None = None

    def start_gc(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()

    def clear_gc(self) -> None:
        """Forget the collections counted so far (the server calls it once loading and ``freeze_heap`` are done:
        their collections, the freeze's full one among them, are not pauses of serving)."""
        with self._lock:
            for g in GENERATIONS:
                self.gc_count[g], self.gc_total_ms[g], self.gc_max_ms[g] = 0, 0.0, 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        now, me = time.perf_counter(), threading.get_ident()
        if phase == "start":
            self._gc_started[me] = now
            return
        began = self._gc_started.pop(me, None)
        if began is None:
            return
        gen, ms = info["generation"], 1e3 * (now - began)
        with self._lock:
            self.gc_count[gen] += 1
            self.gc_total_ms[gen] += ms
            self.gc_max_ms[gen] = max(self.gc_max_ms[gen], ms)

    def watch_loop(self) -> None:
        """Start the lag probe on the running loop (idempotent; call from a coroutine)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._probe_lag())

    async def _probe_lag(self) -> None:
        while True:
            due = time.perf_counter() + self.lag_interval_s
            await asyncio.sleep(self.lag_interval_s)
            self.lags_ms.append(max(0.0, 1e3 * (time.perf_counter() - due)))

    def snapshot(self) -> dict:
        with self._lock:
            gc_stats = {
                f"gen{g}": {
                    "count": self.gc_count[g],
                    "total_ms": round(self.gc_total_ms[g], 1),
                    "max_ms": round(self.gc_max_ms[g], 1),
                }  # fmt: skip
                for g in GENERATIONS
                if self.gc_count[g]
            }
        lags = np.fromiter(self.lags_ms, float)  # a copy: the loop keeps appending
        lag = {"samples": 0}
        if len(lags):
            p50, p99 = np.percentile(lags, [50, 99])
            lag = {"samples": len(lags), "p50_ms": round(p50, 2), "p99_ms": round(p99, 2),
                   "max_ms": round(float(lags.max()), 1)}  # fmt: skip
        return {"gc": gc_stats, "frozen_objects": gc.get_freeze_count(), "event_loop_lag": lag}
