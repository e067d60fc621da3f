"""The per-request user side from the Feast online store: profile, recent events, cached embedding.

Reads run on a small worker pool and are awaited with a deadline; a slow or failing store yields ``None`` plus
the reason, and the request continues on the degraded path. Concurrent requests may wait for a worker (up to
``max_waiting`` of them, each within its own deadline; a read that times out while waiting is cancelled), so a
burst is served, not degraded. When the workers are stuck on earlier reads (a locked or hung store) and that many
reads already wait, new requests do not queue behind them: they are answered degraded at once.

``read_then`` hands a read's result to a continuation on the reading thread itself (serving scores there: no hop
back to the event loop between the read and the scoring), unless the event loop gave up on the read first
(``PendingRead``).

The budget adapts to the store as measured: every read's duration (late ones included: the worker finishes them)
goes into a window of the last ``WINDOW`` reads, and every ``RETUNE_EVERY`` reads the budget becomes
``MARGIN`` x their p99.9, kept between the configured floor and cap. A fixed 8 ms budget on a busy 2-core machine
degraded 10-16% of answers (issue 17); a budget from the store's own tail keeps that near 0.1% while a
store that stops answering still costs a request at most the cap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from features.feature_repo.online_read import Reader, online_reader, sqlite_connection
from serving.hot_threads import HotThreadPool
from serving.runtime import run_on_every_thread

WINDOW, RETUNE_EVERY, MIN_SAMPLES, MARGIN = 2048, 128, 64, 1.5
RECENT_FIELDS = ("recent_ad_ids", "recent_actions", "recent_category_ids", "recent_ts")
# Optional per-event fields: read when the feature view provides them, else filled (see serving.inputs).
OPTIONAL_RECENT_FIELDS = ("recent_surfaces", "recent_advertiser_ids")


@dataclass
class UserFeatures:
    """One user's online features; ``None`` fields were absent from the store (unknown user, no embedding)."""

    age: float | None
    gender: int | None
    country: int | None
    recent: dict[str, np.ndarray] | None  # RECENT_FIELDS (+ any optional ones) -> (n,) int64, oldest first
    embedding: np.ndarray | None  # (E,) float32
    embedding_version: str | None

    @property
    def known(self) -> bool:
        return self.gender is not None or self.recent is not None or self.embedding is not None


def parse_online_row(row: dict) -> UserFeatures:
    """One entity's ``OnlineResponse.to_dict()`` (single-element lists) -> UserFeatures."""

    def one(name):
        col = row.get(name)
        return col[0] if col else None

    recent = None
    if one("recent_ad_ids") is not None:
        recent = {}
        for name in (*RECENT_FIELDS, *OPTIONAL_RECENT_FIELDS):
            value = one(name)
            if value is not None:
                recent[name] = np.asarray(value, np.int64)
        lengths = {len(v) for v in recent.values()}
        if len(lengths) != 1:
            raise ValueError(f"recent-event lists of different lengths {sorted(lengths)} in the online store")
    emb = one("user_embedding")
    return UserFeatures(
        age=None if one("user_age") is None else float(one("user_age")),
        gender=None if one("user_gender") is None else int(one("user_gender")),
        country=None if one("user_country") is None else int(one("user_country")),
        recent=recent,
        embedding=None if emb is None or len(emb) == 0 else np.asarray(emb, np.float32),
        embedding_version=one("model_version"),
    )


def adaptive_budget(durations_s, floor_s: float, cap_s: float) -> float:
    """``MARGIN`` x the p99.9 of recent read durations, within [floor_s, cap_s] (floor_s until enough samples)."""
    if len(durations_s) < MIN_SAMPLES:
        return floor_s
    return float(min(cap_s, max(floor_s, MARGIN * np.percentile(np.fromiter(durations_s, float), 99.9))))


_LOCK = type(threading.Lock())


@contextlib.contextmanager
def _busy_timeout(conn: sqlite3.Connection, ms: int):
    """SQLite's busy timeout of ``conn`` set to ``ms`` inside, restored after (the caller holds the store's lock:
    no other thread uses the connection meanwhile)."""
    previous = conn.execute("PRAGMA busy_timeout").fetchone()[0]
    conn.execute(f"PRAGMA busy_timeout = {int(ms)}")
    try:
        yield
    finally:
        conn.execute(f"PRAGMA busy_timeout = {int(previous)}")


class StoreBusy(Exception):
    """The SQLite file is locked by a writer (``read_now``: read on a thread instead)."""


class StoreReadError(RuntimeError):
    """An online-store read failed (the message names the store's exception)."""


def store_guard(store) -> contextlib.AbstractContextManager:
    """What every thread reading ``store`` must hold: a lock for Feast's SQLite online store, nothing otherwise.

    That store gives every thread ONE shared sqlite3 connection. While one read waits inside SQLite for a
    locked file, another thread's parameter binding blocks on the connection's mutex WITH the GIL held, freezing
    the whole process (the event loop included) for the busy timeout. Reads wait on this lock instead (GIL
    released). Redis clients are thread-safe: no lock.
    """
    kind = getattr(getattr(getattr(store, "config", None), "online_store", None), "type", "")
    return threading.Lock() if kind == "sqlite" else contextlib.nullcontext()


class PendingRead:
    """A read started by ``read_then``. Its worker once the read is done and the event loop once the budget has
    passed both ``claim`` it: the first one continues the request (with the features, or without them)."""

    def __init__(self):
        self._claimed = threading.Lock()

    def claim(self) -> bool:
        """True for the first caller only (a lock's non-blocking acquire is atomic)."""
        return self._claimed.acquire(blocking=False)


class UserFeatureReader:
    """``await reader.read(user_id)`` -> (UserFeatures | None, degraded reason | None); or ``read_then``."""

    def __init__(
        self,
        store,
        feature_service: str,
        timeout_s: float,
        workers: int = 4,
        max_waiting: int = 0,
        guard: contextlib.AbstractContextManager | None = None,
        max_timeout_s: float = 0.0,
        continuation_threads: int = 0,
        thread_init: Callable[[], None] | None = None,
    ):
        """``continuation_threads``: threads beyond ``workers`` for ``read_then``'s continuations, so that reads
        never wait behind them; ``thread_init`` runs on each thread before its first read."""
        self.store = store
        self.guard = guard if guard is not None else store_guard(store)
        self.feature_service = feature_service
        self.timeout_s = self.floor_s = timeout_s  # the current budget: adapts within [floor_s, cap_s]
        self.cap_s = max(max_timeout_s, timeout_s)
        self._took: deque[float] = deque(maxlen=WINDOW)
        self._since_retune = 0
        self.workers = workers
        self.max_waiting = max_waiting
        self.threads = workers + continuation_threads
        self._pool = HotThreadPool(self.threads, "feast-read", initializer=thread_init)
        self._busy = 0
        self._lock = threading.Lock()
        self._read_rows: Reader | None = None  # resolved at the first read
        # ``read_now``'s SQLite connection (False: the store has none), resolved at its first call
        self._sqlite: sqlite3.Connection | bool | None = None

    def _read_sync(self, user_id: int) -> UserFeatures:
        started = time.perf_counter()
        try:
            return self._read_store(user_id)
        finally:
            self._observe(time.perf_counter() - started)

    def _observe(self, seconds: float) -> None:
        with self._lock:
            self._took.append(seconds)
            self._since_retune += 1
            if self._since_retune < RETUNE_EVERY:
                return
            self._since_retune = 0
            samples = list(self._took)
        self.timeout_s = adaptive_budget(samples, self.floor_s, self.cap_s)

    def warm_up(self, user_id: int, reads: int) -> None:
        """Synchronous reads before serving: the store's first reads are slow (connections, registry) and the
        budget starts from measured durations instead of the floor."""
        for _ in range(reads):
            try:
                self._read_sync(user_id)
            except StoreReadError:
                return
        with self._lock:
            samples = list(self._took)
        self.timeout_s = adaptive_budget(samples, self.floor_s, self.cap_s)

    def on_every_thread(self, fn: Callable[[], None]) -> None:
        """``fn`` once on each reading thread (warm-up of the continuations that run there)."""
        run_on_every_thread(self._pool, self.threads, fn)

    def _read_store(self, user_id: int) -> UserFeatures:
        with self.guard:
            return self._read_unguarded(user_id)

    def _read_unguarded(self, user_id: int, no_wait: bool = False) -> UserFeatures:
        """The read (its guard held by the caller); ``no_wait`` (``read_now``): SQLite's busy timeout at 0 for this
        read, ``StoreBusy`` when the file is locked."""
        if self._read_rows is None:  # the service's own reads, 0.27 instead of 0.61 ms of CPU (Feast's SDK)
            self._read_rows = online_reader(self.store, self.feature_service, "user_id")
        try:
            with _busy_timeout(self._sqlite, 0) if no_wait else contextlib.nullcontext():
                row, _ = self._read_rows([user_id])
        except Exception as err:  # noqa: BLE001 (reported as a degraded answer by ``read``)
            if no_wait and getattr(err, "sqlite_errorcode", None) == sqlite3.SQLITE_BUSY:
                raise StoreBusy from None
            problem = f"{type(err).__name__}: {err}"
        else:
            return parse_online_row(row)
        # Raised only here, with the store's exception gone: its traceback holds the store's frames (an sqlite3
        # cursor), which would otherwise be freed later on the event loop, blocking it on the connection.
        raise StoreReadError(problem)

    def read_now(self, user_id: int) -> tuple[UserFeatures | None, str | None] | None:
        """``read`` on the calling thread where it cannot wait; None where it could (then read on a thread, within
        the budget). It cannot wait on a local SQLite store whose lock (``store_guard``) is free this instant, read
        with SQLite's busy timeout at 0: a file another process is writing answers "busy" at once instead of after
        the timeout. A network store could: a hung read would not be abandoned at its budget."""
        lock = self.guard
        if not isinstance(lock, _LOCK) or not lock.acquire(blocking=False):
            return None
        started = time.perf_counter()
        try:
            if self._sqlite is None:
                self._sqlite = sqlite_connection(self.store) or False
            if self._sqlite is False:
                return None
            return self._read_unguarded(user_id, no_wait=True), None
        except StoreBusy:
            return None
        except StoreReadError as err:
            return None, f"feature_store_error: {err}"[:200]
        except Exception as err:  # noqa: BLE001 (as ``read_then``: a store failure degrades the answer)
            return None, f"feature_store_error: {type(err).__name__}: {err}"[:200]
        finally:
            lock.release()
            self._observe(time.perf_counter() - started)

    def _release(self, _fut=None) -> None:  # a read finished or was cancelled before it started
        with self._lock:
            self._busy -= 1

    def _submit(self, fn, *args) -> concurrent.futures.Future | str:
        """``fn`` on a worker, counted as a read until ``_release``; or why not (all busy, pool shut down)."""
        with self._lock:
            if self._busy >= self.workers + self.max_waiting:  # running or waiting for a worker
                return "feature_store_busy"
            self._busy += 1
        try:
            return self._pool.submit(fn, *args)
        except RuntimeError as err:  # pool shut down
            self._release()
            return f"feature_store_error: {err}"

    def read_then(
        self, user_id: int, then: Callable[[UserFeatures | None, str | None], None]
    ) -> PendingRead | str:
        """Start a read whose outcome, ``(features, None)`` or ``(None, degraded reason)``, goes to ``then`` on the
        reading thread unless the caller's ``PendingRead.claim`` came first (the caller claims the read once
        ``timeout_s`` has passed); or the reason it could not start (``then`` is not called then)."""
        pending = PendingRead()

        def run() -> None:
            try:
                feats, problem = self._read_sync(user_id), None
            except StoreReadError as err:
                feats, problem = None, f"feature_store_error: {err}"[:200]
            except Exception as err:  # noqa: BLE001 (as ``read``: a store failure degrades the answer)
                feats, problem = None, f"feature_store_error: {type(err).__name__}: {err}"[:200]
            finally:
                self._release()  # the read is over; the continuation is not a read
            if pending.claim():
                then(feats, problem)

        fut = self._submit(run)
        if isinstance(fut, str):
            return fut
        fut.add_done_callback(lambda f: f.cancelled() and self._release())  # cancelled before it started
        return pending

    async def read(self, user_id: int) -> tuple[UserFeatures | None, str | None]:
        fut = self._submit(self._read_sync, user_id)
        if isinstance(fut, str):
            return None, fut
        fut.add_done_callback(self._release)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s), None
        except TimeoutError:
            return None, "feature_store_timeout"
        except StoreReadError as err:
            return None, f"feature_store_error: {err}"[:200]
        except Exception as err:  # noqa: BLE001 (a store failure degrades the answer, never fails it)
            return None, f"feature_store_error: {type(err).__name__}: {err}"[:200]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
