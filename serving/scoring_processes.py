"""Scoring in worker processes (``scoring.processes`` > 0): concurrent requests share no GIL.

Why: every torch op outside the TorchScript call releases and re-takes the GIL, and so does every Feast read and
every parse on the event loop. Scoring threads in the server process queue on that one lock: under two clients the
kernel's task switching was 12% of the server's CPU after the candidate path went to TorchScript. Two threads
calling ``score_shared`` in a loop cost ~20% more CPU per call than one thread; two processes cost what one does
(docs/serving-speed.md).

Each worker process loads the served model itself (the same bundle or registry URI), compiles the one-user path and
keeps its own candidate cache; it answers one job at a time over a pipe:

    server -> worker   ("ads", AdArrays)              before a job, when the snapshot changed since the last one
                       ("rank", Job, ads_loaded)
    worker -> server   ("ok", answer) | ("cancelled", None) | ("error", "<type>: <message>")

The event loop reads the answers itself (``loop.add_reader`` on each pipe): no thread between a worker and the loop.
A worker goes back to the idle pool only once its answer is read, so a request abandoned at its deadline never hands
a busy worker to the next one (the worker stops at its next checkpoint: ``Job.check``). A worker that dies fails its
request (the gateway answers 503) and is replaced in the background after a backoff (``gemflow.processes.Backoff``); deaths
and restarts are ``/metrics`` counters (``child="scoring"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from gemflow.processes import Backoff, stop_processes
from serving.children import clean_environ
from serving.request_scorer import Cancelled, Job
from serving.stats import CHILD_DEATHS, CHILD_RESTARTS

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # a worker imports torch and loads the model (seconds on a busy machine)


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker process needs to build its ``RequestScorer`` (picklable)."""

    model_uri: str
    tracking_uri: str
    workspace: str
    model_name: str
    batch_size: int
    cache_bytes: int
    expected_user_model_version: str
    torchscript: bool
    warm_up_size: int  # candidates of the throwaway requests scored before the first real one
    one_user_variant: str | None = (
        None  # the server's choice (``models.inference.one_user.script``), for every worker
    )


class WorkerLost(RuntimeError):
    """A scoring worker process died before answering."""


def _serve_jobs(conn: Connection, setup: WorkerSetup) -> None:
    """The worker process: load, say ready, answer jobs until told to stop or the server goes away."""
    from pathlib import Path

    from gemflow.workspace import Workspace
    from serving import runtime
    from serving.model_source import load_served_model
    from serving.request_scorer import RequestScorer

    runtime.configure(1)  # one intra-op thread; freed memory kept in the heap (serving.runtime)
    served = load_served_model(setup.model_uri, setup.tracking_uri, Workspace(Path(setup.workspace)))
    if setup.torchscript:
        served.ranker.script_one_user(setup.one_user_variant)
    scorer = RequestScorer(served, setup.model_name, setup.batch_size, setup.cache_bytes,
                           setup.expected_user_model_version)  # fmt: skip
    conn.send(("ready", None))
    ads = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        if message[0] == "stop":
            return
        if (
            message[0] == "ads"
        ):  # a new snapshot: every surface's candidate rows before the first job needs them
            scorer.warm_up(message[1], setup.warm_up_size, times=3 if ads is None else 0)
            ads = message[1]
            continue
        _, job, loaded = message
        try:
            conn.send(("ok", scorer.rank(job, ads, loaded)))
        except Cancelled:
            conn.send(("cancelled", None))
        except Exception as err:  # noqa: BLE001 (reported to the server, which answers 500 and logs it)
            conn.send(("error", f"{type(err).__name__}: {err}"[:500]))


class _Worker:
    def __init__(self, ctx, setup: WorkerSetup, index: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve_jobs, args=(child, setup), name=f"gemflow-score-{index}", daemon=True
        )
        with clean_environ():
            self.proc.start()
        child.close()
        self.index = index
        self.ads = None  # the AdArrays object it holds
        self.pending: asyncio.Future | None = None

    def wait_ready(self, timeout_s: float) -> None:
        if not self.conn.poll(timeout_s):
            self.proc.kill()
            raise RuntimeError(f"scoring worker {self.index} did not start within {timeout_s:.0f} s")
        try:
            kind, _ = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"scoring worker {self.index} exited while loading (exit code "
                               f"{self.proc.exitcode}); its output is above") from None  # fmt: skip
        assert kind == "ready", kind


class ScoringProcesses:
    """``count`` worker processes; ``await rank(job, ads, loaded)`` scores a job on an idle one."""

    def __init__(self, setup: WorkerSetup, count: int):
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and torch state
        self._setup = setup
        self._backoff = Backoff()
        self._workers = [_Worker(self._ctx, setup, i) for i in range(count)]
        for worker in self._workers:
            worker.wait_ready(START_TIMEOUT_S)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Queue[_Worker] | None = None
        self._closed = False

    @property
    def alive(self) -> int:
        return sum(w.proc.is_alive() for w in self._workers)

    def _attach(self) -> asyncio.Queue[_Worker]:
        """Bind to the running loop on first use: its idle queue and a reader per worker's pipe."""
        if self._idle is None:
            self._loop, self._idle = asyncio.get_running_loop(), asyncio.Queue()
            for worker in self._workers:
                self._enlist(worker)
        return self._idle

    def _enlist(self, worker: _Worker) -> None:
        self._loop.add_reader(worker.conn.fileno(), self._on_answer, worker)
        self._idle.put_nowait(worker)

    def prime(self, ads) -> None:
        """Send every worker the current ad arrays before serving: each builds its candidate rows and scores a few
        throwaway requests, so the first real request finds it warm."""
        for worker in self._workers:
            worker.conn.send(("ads", ads))
            worker.ads = ads

    async def rank(self, job: Job, ads, loaded: bool) -> dict:
        """The worker's answer to ``job``; raises Cancelled (deadline), WorkerLost (the worker died)."""
        idle = self._attach()
        worker = await idle.get()
        while not worker.proc.is_alive():  # died while idle, before its reader saw the pipe close
            self._lost(worker)
            worker = await idle.get()
        future = self._loop.create_future()
        worker.pending = future
        try:
            if worker.ads is not ads:
                worker.conn.send(("ads", ads))  # a few hundred KB, once per ad-table refresh and worker
                worker.ads = ads
            worker.conn.send(("rank", job, loaded))
        except OSError:  # the pipe broke: the worker is gone (its reader reports it too)
            self._lost(worker)
            raise WorkerLost(f"scoring worker {worker.index} is gone") from None
        kind, value = await future  # cancelling this leaves the worker busy until its answer is read
        if kind == "cancelled":
            raise Cancelled
        if kind == "error":
            raise RuntimeError(f"scoring worker {worker.index}: {value}")
        return value

    def _on_answer(self, worker: _Worker) -> None:
        """The loop's reader callback: a worker answered (or its pipe closed)."""
        try:
            answer = worker.conn.recv()
        except (EOFError, OSError):
            self._lost(worker)
            return
        future, worker.pending = worker.pending, None
        if future is not None and not future.done():
            future.set_result(answer)
        self._idle.put_nowait(worker)

    def _lost(self, worker: _Worker) -> None:
        """A worker died: fail its request, stop watching its pipe, start a replacement in the background."""
        if worker not in self._workers:
            return
        self._workers.remove(worker)
        self._loop.remove_reader(worker.conn.fileno())
        worker.conn.close()
        if worker.pending is not None and not worker.pending.done():
            worker.pending.set_exception(WorkerLost(f"scoring worker {worker.index} died (exit code "
                                                    f"{worker.proc.exitcode})"))  # fmt: skip
        CHILD_DEATHS.labels(child="scoring").inc()
        wait = self._backoff.next_delay()
        log.error(
            "scoring worker %d died (exit code %s); a replacement starts in %.1f s",
            worker.index,
            worker.proc.exitcode,
            wait,
        )
        if not self._closed:
            threading.Thread(target=self._replace, args=(worker.index, wait), daemon=True).start()

    def _replace(self, index: int, wait: float) -> None:
        time.sleep(wait)
        try:
            worker = _Worker(self._ctx, self._setup, index)
            worker.wait_ready(START_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 (logged; the pool serves on with the workers it has)
            if not self._closed:
                log.error("scoring worker %d could not be replaced: %s", index, err)
            return

        def join() -> None:
            if self._closed:
                worker.proc.kill()
                return
            self._workers.append(worker)
            self._enlist(worker)
            CHILD_RESTARTS.labels(child="scoring").inc()

        self._loop.call_soon_threadsafe(join)

    def close(self) -> None:
        self._closed = True
        for worker in list(self._workers):
            if self._loop is not None and not self._loop.is_closed():
                with contextlib.suppress(ValueError, OSError, RuntimeError):
                    self._loop.remove_reader(worker.conn.fileno())
            with contextlib.suppress(OSError):
                worker.conn.send(("stop",))
        stop_processes([w.proc for w in self._workers], grace=5.0, terminate=False)  # asked to stop above
