"""Candidate (ad) features in process: numpy arrays indexed by ad id, refreshed from Feast in the background.

One Feast online read of 1,000 ads costs more than a whole request's budget, so requests never read ads from
the store: they index an immutable ``AdSnapshot``. A background thread builds a new snapshot every
``refresh_seconds`` and swaps the reference (one assignment; readers take the reference once per request, so a
request never sees half a refresh). A failed refresh keeps the previous snapshot and is reported.

Reading 6,000 ads through the Feast SDK is ~1.4 s of pure Python. Run on a thread of the serving process, that
holds the GIL the event loop and the scoring threads need, and every request in flight meanwhile waits on it
(the open-loop tail of ``bench/serve.py``). ``serving.ad_refresh_process.ProcessLoader`` runs the same loader in a child process (its own
store handle, lower CPU priority); only the finished snapshot, a few numpy arrays, crosses back.

Most refreshes of a serving replica find nothing new (ad features change when a materialization runs). On Feast's
SQLite online store the loader first asks SQLite whether any connection committed since its last snapshot
(``sqlite_version``: one ``PRAGMA data_version``, exact) and skips the read if none did and the ad universe is
the same: the ~1 s of CPU per refresh was ~0.2 ms per request at 100 req/s (docs/serving-speed.md, round 5).
Other online stores have no such counter: every refresh reads them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from features.feature_repo.online_read import online_reader
from serving.stats import AD_REFRESH_FAILING, AD_REFRESHES

log = logging.getLogger(__name__)

UTC = dt.UTC
# Ads are held in arrays indexed by their id while max id + 1 <= SPARSE_FACTOR * ads + SPARSE_SLACK.
SPARSE_FACTOR, SPARSE_SLACK = 8, 1 << 20


@dataclass(frozen=True)
class AdSnapshot:
    """``columns[name][pos]`` (float64, NaN where the store has no value); ``known[pos]`` marks loaded ads.

    ``pos`` is the ad id itself while ids are small (an array of max id + 1 rows), else the ad's place in the
    sorted ``ids`` (hashed text ids, 1e11-sized integers): ``positions`` turns raw ids into either."""

    columns: dict[str, np.ndarray]
    known: np.ndarray  # (positions,) bool
    as_of: dt.datetime | None  # newest feature timestamp in the snapshot (the data's "as of")
    loaded_at: dt.datetime  # wall clock of the refresh that built it
    ids: np.ndarray | None = None  # sorted raw ad ids when positions are not the ids themselves

    def positions(self, ad_ids: np.ndarray) -> np.ndarray:
        """Each raw ad id's position in the arrays, -1 outside them (``known`` still says whether it loaded)."""
        ad_ids = np.asarray(ad_ids, np.int64)
        if self.ids is None:
            return np.where((ad_ids >= 0) & (ad_ids < len(self.known)), ad_ids, -1)
        if not len(self.ids):
            return np.full(ad_ids.shape, -1, np.int64)
        at = np.minimum(np.searchsorted(self.ids, ad_ids), len(self.ids) - 1)
        return np.where(self.ids[at] == ad_ids, at, -1)

    def raw_ids(self) -> np.ndarray:
        """The raw ad id of every position."""
        return np.arange(len(self.known), dtype=np.int64) if self.ids is None else self.ids

    @property
    def num_ads(self) -> int:
        return int(self.known.sum())

    @classmethod
    def empty(cls, columns: list[str]) -> AdSnapshot:
        return cls({c: np.zeros(0) for c in columns}, np.zeros(0, bool), None, dt.datetime.now(UTC))

    @classmethod
    def from_rows(
        cls, ad_ids: np.ndarray, values: dict[str, np.ndarray], as_of: dt.datetime | None
    ) -> AdSnapshot:
        ad_ids = np.asarray(ad_ids, np.int64)
        if len(ad_ids) and ad_ids.min() < 0:
            raise ValueError("ad ids must be >= 0")
        size = int(ad_ids.max()) + 1 if len(ad_ids) else 0
        ids = None
        if size > SPARSE_FACTOR * len(ad_ids) + SPARSE_SLACK:  # large ids: sorted, searched per request
            order = np.argsort(ad_ids, kind="stable")
            ids, ad_ids = ad_ids[order], np.arange(len(ad_ids))
            values = {name: np.asarray(col)[order] for name, col in values.items()}
            size = len(ids)
        known = np.zeros(size, bool)
        known[ad_ids] = True
        columns = {}
        for name, col in values.items():
            arr = np.full(size, np.nan)
            arr[ad_ids] = np.asarray(col, np.float64)
            columns[name] = arr
        return cls(columns, known, as_of, dt.datetime.now(UTC), ids)

    def lookup(self, ad_ids: np.ndarray, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(N, len(names)) float64 features (NaN for unknown ads or missing values) and the (N,) known mask."""
        pos = self.positions(ad_ids)
        inside = pos >= 0
        idx = np.where(inside, pos, 0)
        known = inside & (self.known[idx] if len(self.known) else False)
        out = np.full((len(ad_ids), len(names)), np.nan)
        for j, name in enumerate(names):
            col = self.columns.get(name)
            if col is not None and len(col):
                out[:, j] = np.where(known, col[idx], np.nan)
        return out, known


Loader = Callable[[], AdSnapshot | None]  # None: nothing changed since the loader's last snapshot


@dataclass
class AdTable:
    """Holds the current snapshot and refreshes it with ``loader`` on a daemon thread.

    ``max_failures`` consecutive failed refreshes make the table ``stale`` (the server's readiness turns false: new
    and paused ads would otherwise be served from an old snapshot for as long as the failures last); 0 = never.

    ``initial_loader`` (optional) builds the snapshots until the first one loads: the server is not ready before
    that, so no request needs the GIL it holds, and it must not wait on the low-priority refresh process (spawned,
    imports, ``nice 19``: on a machine at load 10 its first load took over 300 s)."""

    loader: Loader
    refresh_seconds: float = 60.0
    initial_loader: Loader | None = None
    snapshot: AdSnapshot = field(default_factory=lambda: AdSnapshot.empty([]))
    last_error: str | None = None
    refreshes: int = 0
    unchanged: int = 0  # refreshes that found the store unchanged (the snapshot stays)
    failures: int = 0
    failed_in_a_row: int = 0
    max_failures: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def loaded(self) -> bool:
        return self.refreshes > 0

    @property
    def stale(self) -> bool:
        return 0 < self.max_failures <= self.failed_in_a_row

    def refresh(self) -> bool:
        """Build and swap in a new snapshot; on failure keep the old one and record why."""
        t0 = time.perf_counter()
        load = self.initial_loader if self.initial_loader is not None and not self.loaded else self.loader
        try:
            snap = load()
        except Exception as err:  # noqa: BLE001 (any store failure must leave serving up)
            self.failures += 1
            self.failed_in_a_row += 1
            AD_REFRESHES.labels(outcome="failed").inc()
            AD_REFRESH_FAILING.set(self.failed_in_a_row)
            self.last_error = f"{type(err).__name__}: {err}"
            log.warning(
                "ad table refresh failed (keeping the snapshot from %s): %s",
                self.snapshot.loaded_at,
                self.last_error,  # with the type: a timeout's message alone is empty
            )
            return False
        self.failed_in_a_row = 0
        AD_REFRESH_FAILING.set(0)
        self.last_error = None
        AD_REFRESHES.labels(outcome="unchanged" if snap is None else "loaded").inc()
        if snap is None:
            self.unchanged += 1
            return True
        self.snapshot = snap
        self.refreshes += 1
        log.info(
            "ad table: %d ads as of %s (%.0f ms)", snap.num_ads, snap.as_of, 1e3 * (time.perf_counter() - t0)
        )
        return True

    def start(self) -> None:
        """First refresh now (so a healthy store serves from the first request), then in the background."""
        self.refresh()
        prime = getattr(self.loader, "start", None)  # a ProcessLoader spawns its child now
        if prime is not None:
            prime()
        self._thread = threading.Thread(target=self._loop, name="ad-table-refresh", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_seconds if self.loaded else min(self.refresh_seconds, 2.0)):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        close = getattr(self.loader, "close", None)  # a ProcessLoader's child process
        if close is not None:
            close()

    def status(self) -> dict:
        snap = self.snapshot
        return {
            "loaded": self.loaded,
            "ads": snap.num_ads,
            "as_of": snap.as_of.isoformat() if snap.as_of else None,
            "loaded_at": snap.loaded_at.isoformat() if self.loaded else None,
            "refreshes": self.refreshes,
            "unchanged": self.unchanged,
            "failures": self.failures,
            "failed_in_a_row": self.failed_in_a_row,
            "stale": self.stale,
            "last_error": self.last_error,
        }


# ------------------------------------------------------------------------------------------ Feast loader
def sqlite_version(store) -> Callable[[], tuple | None]:
    """For Feast's SQLite online store, a callable returning a token that changes whenever any connection commits
    to the store's file or the file is replaced; for other stores, one returning None (unknown: always read).

    The token is (device, inode, ``PRAGMA data_version``) on a read-only connection of its own: SQLite changes
    that pragma's value exactly when another connection commits (a materialization, a push)."""
    online = getattr(getattr(store, "config", None), "online_store", None)
    if getattr(online, "type", "") != "sqlite":
        return lambda: None
    path = Path(online.path)
    if not path.is_absolute() and store.config.repo_path:
        path = Path(store.config.repo_path) / path
    opened: dict = {}  # the connection and the (device, inode) of the file it has open

    def version() -> tuple | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        identity = (st.st_dev, st.st_ino)
        if opened.get("identity") != identity:
            if "conn" in opened:
                opened["conn"].close()
            opened["conn"] = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, check_same_thread=False)
            opened["identity"] = identity
        return (*identity, opened["conn"].execute("PRAGMA data_version").fetchone()[0])

    return version


def feast_ad_loader(
    store,
    ad_ids: Callable[[], np.ndarray],
    feature_service: str,
    chunk: int = 2000,
    guard=None,
    version: Callable[[], tuple | None] | None = None,
) -> Loader:
    """A loader reading every ad of ``ad_ids()`` with an online read of ``feature_service`` (``online_reader``)
    (each chunk under ``guard``, ``serving.user_features.store_guard``). With ``version`` (``sqlite_version``) it
    returns None instead when the store's version and the ad ids are those of its last snapshot."""
    guard = guard if guard is not None else contextlib.nullcontext()
    last: dict = {}  # "version" and "ids" of the last snapshot built (recorded only once it is built)
    reader: dict = {}  # "chunk": the online reader of feature_service

    def load() -> AdSnapshot | None:
        ids = np.unique(np.asarray(ad_ids(), np.int64))
        # the version from before the read: a write during the read shows as a change next time
        seen = version() if version is not None else None
        if seen is not None and seen == last.get("version") and np.array_equal(ids, last.get("ids")):
            return None
        snap = read(ids)
        last.update(version=seen, ids=ids)
        return snap

    def read(ids: np.ndarray) -> AdSnapshot:
        if "chunk" not in reader:  # resolved once (6,000 ads: 1.1 s of CPU per read, Feast's SDK 1.7)
            reader["chunk"] = online_reader(store, feature_service, "ad_id")
        values: dict[str, list] = {}
        stamps = []
        for start in range(0, len(ids), chunk):
            with guard:
                columns, newest = reader["chunk"]([int(i) for i in ids[start : start + chunk]])
            for key, col in columns.items():
                if key != "ad_id":
                    values.setdefault(key, []).extend(np.nan if v is None else v for v in col)
            if newest is not None:
                stamps.append(newest)
        as_of = max(stamps, default=None)
        return AdSnapshot.from_rows(ids, {k: np.asarray(v, np.float64) for k, v in values.items()}, as_of)

    return load


def offline_ad_ids(ws, tables: tuple[str, ...] = ("ad_attributes", "ad_stats")) -> Callable[[], np.ndarray]:
    """The ad universe: every ad id in the offline partitions of ``tables`` (the id column only)."""
    import pyarrow.parquet as pq

    def ids() -> np.ndarray:
        seen = [np.zeros(0, np.int64)]
        for table in tables:
            for path in sorted(ws.offline(table).glob("date=*/*.parquet")):
                seen.append(
                    pq.read_table(path, columns=["ad_id"]).column("ad_id").to_numpy().astype(np.int64)
                )
        return np.unique(np.concatenate(seen))

    return ids


def store_ad_loader(ws, store_cfg, feature_service: str, chunk: int = 2000) -> Loader:
    """``feast_ad_loader`` on a store this process opens itself from the workspace and store config (skipping
    unchanged SQLite stores)."""
    from features.store import open_store

    store = open_store(ws, store_cfg)
    return feast_ad_loader(store, offline_ad_ids(ws), feature_service, chunk, version=sqlite_version(store))
