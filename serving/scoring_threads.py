"""Scoring on threads of the server process (``scoring.processes`` = 0, the default), each request's store read and
its scoring chained on one thread.

A request used to cross threads four times: event loop -> store-read thread -> event loop -> scoring thread ->
event loop. Each crossing wakes a thread and passes the GIL. Here the reading thread goes on to score
(``UserFeatureReader.read_then``) and only the answer goes back to the event loop: 3-7% less server CPU per
1,000-candidate request and a fifth fewer context switches, side by side (docs/serving-speed.md, round 4).

- At most ``workers`` requests score at once (``_slots``). A read that finds no free slot hands its request to the
  queue of the scoring pool instead of blocking its reading thread.
- The read budget is a timer on the event loop: when it passes first, the request is scored from the pool without
  the user side (degraded, as before) and the late read's result is dropped by its thread.
- Deadlines as everywhere (``Job.check``): a request whose client was answered 503 stops at its next checkpoint.
- ``scoring.inline`` (on by default): a request that finds the server idle is read and scored on the event loop
  itself, with no thread woken: at 100 req/s the two wakes cost 0.25-0.45 ms of CPU per request
  (docs/serving-speed.md, round 12). Only where that cannot stall the loop or hide a backlog: no other request in
  flight, none answered inline in the last ``INLINE_IDLE_S`` (a request that waited behind one goes to the
  threads, so a busy server reads, admits and sheds as without it), and a read that cannot wait
  (``UserFeatureReader.read_now``: a local SQLite store whose lock is free, a locked file answering "busy" at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable

from serving import runtime
from serving.hot_threads import HotThreadPool
from serving.request_scorer import Job
from serving.user_features import UserFeatureReader

# a request that starts sooner than this after an inline one ended waited behind it: it goes to a thread
INLINE_IDLE_S = 0.002


def _settle(answered: asyncio.Future, result, error: BaseException | None) -> None:
    """On the event loop: deliver an outcome unless the waiting request has gone (cancelled at its deadline)."""
    if answered.done():
        return
    if error is not None:
        answered.set_exception(error)
    else:
        answered.set_result(result)


class ScoringThreads:
    def __init__(self, workers: int, torch_threads: int, rank: Callable[[Job], dict], inline: bool = False):
        self.workers = workers
        self._rank = rank
        self.inline = inline
        self.inlined = 0  # requests read and scored on the event loop
        self._active = 0  # requests inside ``answer`` (the event loop's own count: no lock)
        self._inline_ended = float("-inf")
        self._slots = threading.BoundedSemaphore(workers)
        self._pool = HotThreadPool(
            workers, "score", initializer=runtime.worker_init, initargs=(torch_threads,)
        )

    def on_every_thread(self, fn: Callable[[], None]) -> None:
        """``fn`` once on each thread of the scoring pool (warm-up)."""
        runtime.run_on_every_thread(self._pool, self.workers, fn)

    async def answer(self, reader: UserFeatureReader, job: Job) -> dict:
        """Read ``job``'s user side and score it (``job.feats``, ``job.store_problem`` and ``job.fetch_ms`` are
        filled in on the way); raises what ``rank`` raises (``Cancelled`` past the deadline)."""
        self._active += 1
        try:
            if self.inline and self._active == 1 and time.monotonic() - self._inline_ended > INLINE_IDLE_S:
                outcome = reader.read_now(job.req.user_id)
                if outcome is not None:
                    return self._answer_inline(job, outcome)
            return await self._answer_on_threads(reader, job)
        finally:
            self._active -= 1

    def _answer_inline(self, job: Job, outcome: tuple) -> dict:
        job.feats, job.store_problem = outcome
        job.fetch_ms = 1e3 * (time.perf_counter() - job.started)
        try:
            return self._rank(job)
        finally:
            self.inlined += 1
            self._inline_ended = time.monotonic()

    async def _answer_on_threads(self, reader: UserFeatureReader, job: Job) -> dict:
        loop = asyncio.get_running_loop()
        answered = loop.create_future()
        deliver = functools.partial(self._score, job, answered, loop)

        def on_read(feats, problem) -> None:  # on the reading thread, within the read budget
            job.feats, job.store_problem = feats, problem
            job.fetch_ms = 1e3 * (time.perf_counter() - job.started)
            if self._slots.acquire(blocking=False):
                deliver(True)
            else:
                self._pool.submit(deliver, False)

        def without_read(problem: str) -> None:  # the store could not answer in time: score degraded
            job.store_problem = problem
            job.fetch_ms = 1e3 * (time.perf_counter() - job.started)
            self._pool.submit(deliver, False)

        pending = reader.read_then(job.req.user_id, on_read)
        timer = None
        if isinstance(pending, str):
            without_read(pending)
        else:

            def budget_passed() -> None:
                if pending.claim():  # the read had not finished
                    without_read("feature_store_timeout")

            timer = loop.call_later(reader.timeout_s, budget_passed)
        try:
            return await answered
        except asyncio.CancelledError:
            job.cancelled = True  # a queued job never starts; a running one stops at its next checkpoint
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _score(
        self, job: Job, answered: asyncio.Future, loop: asyncio.AbstractEventLoop, holding: bool
    ) -> None:
        """Score ``job`` on this thread (taking a slot unless ``holding`` one) and send the outcome to the loop."""
        if not holding:
            self._slots.acquire()
        try:
            result, error = self._rank(job), None
        except Exception as err:  # noqa: BLE001 (re-raised by ``answer`` on the event loop)
            result, error = None, err
        finally:
            self._slots.release()
        with contextlib.suppress(RuntimeError):  # the loop has closed (server stopping): nobody waits
            loop.call_soon_threadsafe(_settle, answered, result, error)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
