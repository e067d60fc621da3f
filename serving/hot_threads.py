"""A thread pool that gives each task to the thread that went idle last (LIFO), so the same threads stay warm.

``concurrent.futures.ThreadPoolExecutor``'s idle threads all wait on one queue and take tasks in turn, so under
light load consecutive requests run on different threads. A request run on a thread that last worked several
requests ago finds that thread's malloc arena and tcache, and torch's and oneDNN's per-thread buffers, cold:
in process, one 1,000-candidate request handed to a 6-thread pool costs 15% more CPU than one handed to a 1-thread
pool (3.44 vs 3.02 ms, docs/serving-speed.md round 5). Here the most recently idle thread takes the next task:
at one request at a time, one thread does all the work; at two, two threads do.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable


class _Worker:
    __slots__ = ("task", "wake")

    def __init__(self) -> None:
        self.task = None  # (future, fn, args, kwargs) handed over by ``submit``
        self.wake = threading.Lock()  # held while the worker sleeps; ``submit`` releases it
        self.wake.acquire()


class HotThreadPool(concurrent.futures.Executor):
    """``max_workers`` threads, started at once (each runs ``initializer(*initargs)`` first); ``submit`` hands a
    task to the most recently idle thread, or queues it (FIFO) when every thread is busy."""

    def __init__(
        self,
        max_workers: int,
        thread_name_prefix: str = "hot",
        initializer: Callable[..., None] | None = None,
        initargs: tuple = (),
    ):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # a stack: the thread that went idle last is on top
        self._backlog: collections.deque = collections.deque()  # tasks waiting for a thread
        self._shutdown = False
        self._threads = [
            threading.Thread(
                target=self._run, args=(initializer, initargs), name=f"{thread_name_prefix}_{i}", daemon=True
            )
            for i in range(max_workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        task = (fut, fn, args, kwargs)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._idle:
                worker = self._idle.pop()
                worker.task = task
                worker.wake.release()
            else:
                self._backlog.append(task)
        return fut

    def _run(self, initializer, initargs) -> None:
        if initializer is not None:
            initializer(*initargs)
        me = _Worker()
        while True:
            with self._lock:
                if self._backlog:
                    me.task = self._backlog.popleft()
                elif self._shutdown:
                    return
                else:
                    self._idle.append(me)
            if me.task is None:
                me.wake.acquire()  # until ``submit`` hands a task over or ``shutdown`` wakes everyone
                if me.task is None:
                    continue
            (fut, fn, args, kwargs), me.task = me.task, None
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as err:  # noqa: BLE001 (delivered to whoever waits on the future)
                fut.set_exception(err)
            del fut, fn, args, kwargs  # nothing of a finished task stays alive on an idle thread

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while self._backlog:
                    self._backlog.popleft()[0].cancel()
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.wake.release()
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()
