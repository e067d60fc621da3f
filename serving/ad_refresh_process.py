"""The ad table's refresh in a child process (``ProcessLoader``): the Feast read of every ad, ~1.4 s of pure Python,
holds the GIL that the event loop and the scoring threads need; in a child (its own store handle, the lowest CPU
priority) it does not, and only the finished snapshot, a few numpy arrays, crosses back (``serving.ad_table``)."""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool

from gemflow.processes import Backoff, ProcessRef, when_gone
from serving.ad_table import AdSnapshot, Loader
from serving.children import clean_environ
from serving.stats import CHILD_DEATHS, CHILD_RESTARTS

log = logging.getLogger(__name__)


_CHILD_LOADER: Loader | None = None  # the refresh process's loader, built by the priming or the first refresh


def _child_loader(make_loader: Callable[[], Loader]) -> Loader:
    global _CHILD_LOADER
    if _CHILD_LOADER is None:  # a failure here reaches the parent as a failed refresh, retried next time
        _CHILD_LOADER = make_loader()
    return _CHILD_LOADER


def _load_in_child(make_loader: Callable[[], Loader]) -> AdSnapshot | None:
    return _child_loader(make_loader)()


def _prime_child(make_loader: Callable[[], Loader]) -> None:
    _child_loader(make_loader)


def _init_child(server: ProcessRef) -> None:
    os.nice(19)  # the lowest priority: the refresh runs on cycles request scoring leaves idle
    # a killed server must not leave its refresh process behind (the pool's queues never report it)
    when_gone(server, lambda: os._exit(0))


class ProcessLoader:
    """A ``Loader`` running ``make_loader()``'s loader in one long-lived child process (spawned by ``start`` or on
    first use, with ``serving.children.clean_environ``).

    ``make_loader`` must be picklable (a module-level function or a ``functools.partial`` of one). A refresh
    still running after ``timeout_s`` fails this round (the table keeps its snapshot) and the next call waits for
    that same refresh instead of queueing another. A child that died (killed, or its pool broken) fails its refresh
    and is started again by the first call after ``backoff`` (``gemflow.processes.Backoff``); deaths and restarts
    are counted in ``/metrics`` (``gemflow_ranker_child_deaths`` / ``_restarts``, ``child="ad_refresh"``).
    """

    def __init__(
        self, make_loader: Callable[[], Loader], timeout_s: float = 60.0, backoff: Backoff | None = None
    ):
        self.make_loader, self.timeout_s = make_loader, timeout_s
        self.backoff = backoff if backoff is not None else Backoff()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._restart_at: float | None = None  # set when the child died: no new one before then

    def start(self) -> None:
        """Spawn the child now and let it build its loader (imports, store handle: ~2 s of CPU, at nice 19), so
        that one-time cost falls in the server's start-up instead of under its traffic at the first refresh."""
        try:
            self._submit(_prime_child)
        except BrokenProcessPool:
            self._died()

    def _submit(self, fn: Callable) -> concurrent.futures.Future:
        if self._pool is not None:
            return self._pool.submit(fn, self.make_loader)
        if self._restart_at is not None and (wait := self._restart_at - time.monotonic()) > 0:
            raise RuntimeError(f"the ad-table refresh process died; a new one starts in {wait:.1f} s")
        self._pool = concurrent.futures.ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_child,
            initargs=(ProcessRef.me(),),
        )
        with clean_environ():  # (the pool spawns its child in submit)
            future = self._pool.submit(fn, self.make_loader)
        if self._restart_at is not None:
            self._restart_at = None
            CHILD_RESTARTS.labels(child="ad_refresh").inc()
            log.warning("ad-table refresh process started again")
        return future

    def __call__(self) -> AdSnapshot | None:
        try:
            if self._pending is None or self._pending.done():  # one worker: a load queues behind the priming
                self._pending = self._submit(_load_in_child)
            snap = self._pending.result(timeout=self.timeout_s)
        except BrokenProcessPool:
            wait = self._died()
            raise RuntimeError(
                f"the ad-table refresh process died; a new one starts in {wait:.1f} s"
            ) from None
        self.backoff.reset()
        return snap

    def _died(self) -> float:
        """Count the death, drop the broken pool, and say how long until the next child may start."""
        CHILD_DEATHS.labels(child="ad_refresh").inc()
        self.close()
        wait = self.backoff.next_delay()
        self._restart_at = time.monotonic() + wait
        log.error("the ad-table refresh process died; a new one starts in %.1f s", wait)
        return wait

    def close(self) -> None:
        """Stop the child now. It holds nothing worth a graceful end (it only reads the store), and left to finish
        its work at nice 19 on a busy machine it could take many seconds, while the server's own exit waits for it
        (``concurrent.futures`` joins its executors at interpreter exit). Then the pool's manager thread, which
        notices the killed child at once, is given a moment to finish: one still closing its pipe while the
        interpreter exits made ``concurrent.futures``' exit hook write to a closed descriptor (a traceback in the
        server's log). (``_processes``, ``_executor_manager_thread``: the pool's children and manager thread,
        private but unchanged since Python 3.9.)"""
        if self._pool is not None:
            children = list((getattr(self._pool, "_processes", None) or {}).values())
            manager = getattr(self._pool, "_executor_manager_thread", None)
            self._pool.shutdown(wait=False, cancel_futures=True)
            for child in children:
                child.kill()
            if manager is not None:
                manager.join(timeout=5.0)
        self._pool, self._pending = None, None
