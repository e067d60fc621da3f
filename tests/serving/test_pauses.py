"""The serving process's pause monitor: GC pauses per generation and event-loop lag, as /stats reports them."""

from __future__ import annotations

import asyncio
import gc
import threading
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


def test_clearing_forgets_the_collections_so_far():
    monitor = PauseMonitor()
    monitor.start_gc()
    try:
        gc.collect()
        monitor.clear_gc()
        assert monitor.snapshot()["gc"] == {}
        gc.collect()
    finally:
        monitor.stop()
    assert monitor.snapshot()["gc"]["gen2"]["count"] == 1


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


def test_a_collection_during_a_snapshot_does_not_deadlock_it():
    """The GC callback takes the monitor's lock; a collection triggered by ``snapshot``'s own allocations (on the
    thread that holds it) must not block forever."""
    monitor = PauseMonitor()
    monitor.start_gc()
    before = gc.get_threshold()
    done = threading.Event()

    def snapshots():
        for _ in range(200):
            monitor.snapshot()
        done.set()

    try:
        gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation
        thread = threading.Thread(target=snapshots, daemon=True)
        thread.start()
        assert done.wait(20), "snapshot deadlocked in the GC callback"
    finally:
        gc.set_threshold(*before)
        monitor.stop()
    assert monitor.snapshot()["gc"]["gen0"]["count"] > 0
