"""The LIFO thread pool of the serving process (serving.hot_threads); its CPU effect is measured by bench/serve.py."""

from __future__ import annotations

import threading
import time

import pytest

from serving.hot_threads import HotThreadPool


def _wait_until(condition, timeout=5.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def test_one_task_at_a_time_runs_on_one_thread():
    pool = HotThreadPool(6, "t")
    try:
        used = {pool.submit(threading.get_ident).result(timeout=5) for _ in range(50)}
        assert len(used) == 1  # a FIFO pool (ThreadPoolExecutor) takes its idle threads in turn: 6 here
    finally:
        pool.shutdown()


def test_the_thread_that_went_idle_last_takes_the_next_task():
    pool = HotThreadPool(3, "t")
    gates = [threading.Event() for _ in range(3)]
    try:
        running = [pool.submit(lambda g=g: (g.wait(5), threading.get_ident())[1]) for g in gates]
        for k in (0, 2, 1):  # finish in this order: thread of task 1 went idle last
            gates[k].set()
            running[k].result(timeout=5)
            _wait_until(lambda n=(0, 2, 1).index(k) + 1: len(pool._idle) == n)
        assert pool.submit(threading.get_ident).result(timeout=5) == running[1].result()
    finally:
        pool.shutdown()


def test_tasks_queue_in_order_while_every_thread_is_busy_and_results_and_errors_arrive():
    pool = HotThreadPool(1, "t")
    gate, order = threading.Event(), []
    try:
        blocker = pool.submit(gate.wait, 5)
        queued = [pool.submit(order.append, k) for k in range(5)]
        failing = pool.submit(lambda: 1 / 0)
        gate.set()
        assert blocker.result(timeout=5) is True
        for fut in queued:
            fut.result(timeout=5)
        assert order == [0, 1, 2, 3, 4]
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=5)
        assert pool.submit(lambda a, b=0: a + b, 2, b=3).result(timeout=5) == 5
    finally:
        pool.shutdown()


def test_initializer_runs_on_every_thread_before_its_first_task():
    local, seen = threading.local(), []
    pool = HotThreadPool(3, "t", initializer=lambda tag: setattr(local, "tag", tag), initargs=("ready",))
    try:
        barrier = threading.Barrier(3)

        def task():
            barrier.wait(5)  # three at once: each on its own thread
            seen.append((threading.get_ident(), local.tag))

        for fut in [pool.submit(task) for _ in range(3)]:
            fut.result(timeout=5)
        assert len({ident for ident, _ in seen}) == 3 and {tag for _, tag in seen} == {"ready"}
    finally:
        pool.shutdown()


def test_a_task_cancelled_before_it_starts_never_runs():
    pool = HotThreadPool(1, "t")
    gate, ran = threading.Event(), []
    try:
        pool.submit(gate.wait, 5)
        fut = pool.submit(ran.append, 1)
        assert fut.cancel()
        gate.set()
        pool.submit(lambda: None).result(timeout=5)
        assert ran == []
    finally:
        pool.shutdown()


def test_shutdown_cancels_queued_tasks_refuses_new_ones_and_ends_the_threads():
    pool = HotThreadPool(2, "t")
    gate = threading.Event()
    running = [pool.submit(gate.wait, 5) for _ in range(2)]
    queued = pool.submit(lambda: None)
    threading.Timer(0.05, gate.set).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert queued.cancelled() and all(f.result() for f in running)
    assert not any(t.is_alive() for t in pool._threads)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)


def test_needs_at_least_one_thread():
    with pytest.raises(ValueError, match="max_workers"):
        HotThreadPool(0)
