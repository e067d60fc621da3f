"""The serving process's pause monitor: GC pauses per generation and event-loop lag, as /stats reports them."""

from __future__ import annotations

import asyncio
import gc
import time

from serving.pauses import PauseMonitor, freeze_heap


def test_collections_are_timed_per_generation():
    monitor = PauseMonitor()
    monitor.start_gc()
    try:
        gc.collect(0)
        gc.collect()
    finally:
        monitor.stop()
    gc.collect()  # after stop: not counted
    stats = monitor.snapshot()["gc"]
    assert stats["gen0"]["count"] >= 1 and stats["gen2"]["count"] == 1
    assert 0 < stats["gen2"]["max_ms"] <= stats["gen2"]["total_ms"]


def test_a_blocked_loop_shows_up_as_lag():
    monitor = PauseMonitor(lag_interval_s=0.01)

    async def serve() -> None:
        monitor.watch_loop()
        monitor.watch_loop()  # idempotent: one probe
        await asyncio.sleep(0.1)
        time.sleep(0.08)  # a handler that blocks the loop
        await asyncio.sleep(0.05)
        monitor.stop()

    asyncio.run(serve())
    lag = monitor.snapshot()["event_loop_lag"]
    assert lag["samples"] >= 5
    assert lag["max_ms"] >= 60 and lag["p50_ms"] < 60


def test_freeze_heap_exempts_what_is_alive():
    try:
        assert freeze_heap() > 1000
        # A frozen object that is freed leaves the permanent generation, so the count can only fall between reads
        # (other threads in the test process free objects at any time).
        before = gc.get_freeze_count()
        reported = PauseMonitor().snapshot()["frozen_objects"]
        after = gc.get_freeze_count()
        assert before >= reported >= after > 1000
    finally:
        gc.unfreeze()
