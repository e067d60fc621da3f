"""Retrieval inside the ranker server: the current index + user queries, swapped whole, and the one call a request
makes (``retrieve``).

A ``Snapshot`` is everything one user-model version needs to retrieve: the ANN index over its ad vectors and its
users' queries (both from one ``offline/retrieval/D`` folder that the embedding refresh wrote). The service holds
one reference to the current snapshot; a reload builds the next one completely off to the side and swaps the
reference in one assignment, so a request (which takes the reference once) is answered wholly from one complete
index, old or new, never from a half-built one. Reloads run on a background thread every ``reload_seconds``
when a newer folder (or a newer version) appears.

Versions: the index, the cached queries and the user model the folder records (``user_model.json``: the one a
request's fresh query is computed with, ``serving.retrieval.query``) must be one user-model version; a folder
that mixes them is refused (``SnapshotVersionMismatch``, counted in ``gemflow_retrieval_version_mismatch``) and
the current snapshot keeps serving.

A request's query is fresh where the snapshot's model can compute it, else the user's cached query, else the
catalog's mean user query (a cold-start list), never refused: the ranker still orders what comes back.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from features.feature_repo.offline import partition_days
from gemflow.workspace import Workspace
from models.embeddings.ad_vectors import (
    AD_VECTOR_FILE,
    RETRIEVAL_TABLE,
    USER_QUERY_FILE,
    UserModelRecord,
    UserQueries,
    read_ad_vectors,
    read_user_model_record,
)
from serving.retrieval.config import IndexConfig, RetrievalConfig
from serving.retrieval.eligibility import AdFilter, OfflineEligibility
from serving.retrieval.index import AdIndex, Retrieved, build_index
from serving.retrieval.index_files import current_index, index_meta, load_index
from serving.retrieval.query import Query, QueryModel, fresh_query, load_query_model, warm_up
from serving.stats import RETRIEVAL_VERSION_MISMATCH
from serving.user_features import UserFeatures

log = logging.getLogger(__name__)


class RetrievalUnavailable(RuntimeError):
    """This server has no retrieval index (disabled, or none loaded yet): answered 503."""


class SnapshotVersionMismatch(ValueError):
    """A refresh folder whose files come from different user-model versions: refused, counted."""

    def __init__(self, message: str):
        super().__init__(message)
        RETRIEVAL_VERSION_MISMATCH.inc()


# a refresh folder's recorded user model -> (the loaded model, "") or (None, why not): ``load_query_model``
ModelLoader = Callable[[UserModelRecord], tuple[QueryModel | None, str]]


@dataclass(frozen=True)
class Snapshot:
    index: AdIndex
    queries: UserQueries
    source: str  # what it was built from: the refresh folder, and the index build it mapped (``source_key``)
    cold_query: np.ndarray  # the mean user query: what a user without one retrieves with
    eligibility_key: str = ""  # the eligibility tables it read (``OfflineEligibility.key``)
    query_model: QueryModel | None = None  # the recorded user model: fresh queries (None: cached ones only)
    no_query_model: str = "no_model"  # why there is none

    @property
    def version(self) -> str:
        return self.index.model_version

    def query(self, user_id: int, feats: UserFeatures | None, request_ts: float, delay_s: int | None,
              fresh: bool) -> Query:  # fmt: skip
        """The user's query: fresh (``fresh`` on and computable), else cached, else cold start."""
        why = None
        if fresh:
            if self.query_model is None:
                why = self.no_query_model
            else:
                got = fresh_query(self.query_model, user_id, feats, request_ts, delay_s)
                if isinstance(got, Query):
                    return got
                why = got
        cached = self.queries.lookup(user_id)
        if cached is not None:
            return Query(cached, self.queries.model_version, "cached", why)
        return Query(self.cold_query, self.queries.model_version, "cold_start", why)


def source_key(folder: Path) -> str:
    """The refresh folder, its current index build and its files' versions: a new build, or a re-run of the refresh
    (its vectors rewritten, its model recorded again), is a new source."""
    built = current_index(folder)
    record = read_user_model_record(folder)
    written = [(folder / name).stat().st_mtime_ns if (folder / name).exists() else 0
               for name in (AD_VECTOR_FILE, USER_QUERY_FILE)]  # fmt: skip
    return f"{folder}#{built.name if built else 'built-here'}#{record.model_version if record else '-'}#{written}"


def build_snapshot(
    folder: Path,
    cfg: IndexConfig,
    eligibility: OfflineEligibility | None = None,
    load_model: ModelLoader | None = None,
) -> Snapshot:
    """Index + queries + recorded user model of one refresh folder; their versions must agree (one refresh writes
    them all). The index is the folder's current build, memory-mapped, when one of the configured kind is there;
    else built here. ``load_model`` None: the model is not loaded (fresh queries off)."""
    key = source_key(folder)
    record = read_user_model_record(folder)
    queries = read_ad_vectors(folder, USER_QUERY_FILE)
    built = current_index(folder)
    meta = index_meta(built) if built else None
    usable = meta is not None and meta["model_version"] == queries.model_version
    if usable and meta["kind"] == cfg.resolved_kind(meta["ads"]):
        index = load_index(built, cfg)
        log.info("retrieval: mapped the %s index %s in %.3f s", index.kind, built, index.load_seconds)
    else:
        if meta is not None:  # another kind, or a build from before the vectors were rewritten
            log.warning("retrieval: %s (a %s index of %s) does not fit this server (%s, %s): building its own",
                        built, meta["kind"], meta["model_version"], cfg.kind, queries.model_version)  # fmt: skip
        else:
            log.warning("retrieval: no index file under %s (gemflow retrieval-index writes one): building it "
                        "in this process", folder)  # fmt: skip
        index = build_index(read_ad_vectors(folder, AD_VECTOR_FILE), cfg)
    if queries.model_version != index.model_version:
        raise SnapshotVersionMismatch(
            f"{folder}: user queries of {queries.model_version!r} beside ad vectors of {index.model_version!r}"
        )
    if record is not None and record.model_version != index.model_version:
        raise SnapshotVersionMismatch(
            f"{folder}: user model {record.model_version!r} recorded beside ad vectors of {index.model_version!r}"
        )
    model, why = None, "no_model"
    if record is not None and load_model is not None:
        model, why = load_model(record)
        if model is not None and model.version != index.model_version:
            raise SnapshotVersionMismatch(
                f"{folder}: {record.model_uri} loads as {model.version!r}, the index is {index.model_version!r}"
            )
        if model is not None:
            warm_up(model)  # before the swap: no request pays the first query's set-up
    cold = queries.vectors.mean(0) if len(queries.vectors) else np.zeros(index.dim, np.float32)
    snap = Snapshot(index, queries, key, cold.astype(np.float32), query_model=model, no_query_model=why)
    return with_eligibility(snap, eligibility) if eligibility is not None else snap


def with_eligibility(snap: Snapshot, eligibility: OfflineEligibility) -> Snapshot:
    """The snapshot's index and queries (shared) under the eligibility tables as they are now."""
    key = eligibility.key()
    index = snap.index.with_eligibility(eligibility.build(np.asarray(snap.index.ad_ids)))
    return dataclasses.replace(snap, index=index, eligibility_key=key)


def latest_folder(ws: Workspace) -> Path | None:
    days = [d for d in partition_days(ws, "offline", RETRIEVAL_TABLE)
            if (ws.offline(RETRIEVAL_TABLE, d) / AD_VECTOR_FILE).exists()]  # fmt: skip
    return ws.offline(RETRIEVAL_TABLE, days[-1]) if days else None


class RetrievalService:
    def __init__(self, cfg: RetrievalConfig, ws: Workspace, eligibility: OfflineEligibility | None = None,
                 tracking_uri: str = ""):  # fmt: skip
        """``tracking_uri``: where a recorded ``models:/`` user model is loaded from (the server's)."""
        cfg.validate()
        self.cfg, self.ws = cfg, ws
        self.eligibility = eligibility  # paused ads, surfaces, advertisers; None: every ad everywhere
        self.tracking_uri = tracking_uri
        self._current: Snapshot | None = None
        self._refused = ""  # the source last refused for mixed versions (counted once, not at every reload)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.swaps = 0

    @property
    def current(self) -> Snapshot | None:
        return self._current

    def swap(self, snapshot: Snapshot) -> None:
        """Make ``snapshot`` (complete: built before this call) the one requests use, in one assignment."""
        self._current = snapshot
        self.swaps += 1
        log.info("retrieval index %s (%d ads, %s) from %s", snapshot.version, len(snapshot.index),
                 snapshot.index.kind, snapshot.source)  # fmt: skip

    def source(self) -> Path | None:
        return Path(self.cfg.folder) if self.cfg.folder else latest_folder(self.ws)

    def load_model(self, record: UserModelRecord) -> tuple[QueryModel | None, str]:
        return load_query_model(record, self.tracking_uri, self.ws)

    def load(self) -> bool:
        """Build and swap in the newest refresh's snapshot if it differs from the current one; a snapshot of mixed
        versions is refused (the current one keeps serving)."""
        folder = self.source()
        if folder is None:
            log.warning("retrieval: no refresh has written %s yet", RETRIEVAL_TABLE)
            return False
        current, key = self._current, source_key(folder)
        if current is not None and current.source == key:
            if self.eligibility is None or current.eligibility_key == self.eligibility.key():
                return False
            self.swap(with_eligibility(current, self.eligibility))  # the ad tables changed: same index
            return True
        if key == self._refused:
            return False
        loader = self.load_model if self.cfg.fresh_query else None
        try:
            snapshot = build_snapshot(folder, self.cfg.index, self.eligibility, loader)
        except SnapshotVersionMismatch as err:
            self._refused = key
            log.error("retrieval: refused %s (%s); %s keeps serving", folder, err,
                      current.source if current else "no index")  # fmt: skip
            return False
        self.swap(snapshot)
        return True

    def start(self) -> None:
        import faiss

        faiss.omp_set_num_threads(self.cfg.search_threads)
        self.load()
        if self.cfg.reload_seconds > 0:
            self._thread = threading.Thread(target=self._reload_loop, name="retrieval-reload", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _reload_loop(self) -> None:
        while not self._stop.wait(self.cfg.reload_seconds):
            try:
                self.load()
            except Exception:  # a bad folder keeps the current index serving
                log.exception("retrieval: reload failed; the current index keeps serving")

    def retrieve(
        self,
        user_id: int,
        k: int,
        flt: AdFilter,
        feats: UserFeatures | None = None,
        request_ts: float = 0.0,
        delay_s: int | None = None,
    ) -> tuple[Retrieved, Query]:
        """(the ``k`` best eligible ads for the user, the query they were found with). ``feats``: the user side the
        request read (its recent events make the fresh query), ``request_ts`` / ``delay_s``: the ranker's cutoff."""
        snap = self._current  # once: the whole request uses this snapshot
        if snap is None:
            raise RetrievalUnavailable("retrieval is enabled but no index is loaded yet")
        query = snap.query(user_id, feats, request_ts or time.time(), delay_s, self.cfg.fresh_query)
        t0 = time.perf_counter()
        hits = snap.index.search(query.vector, query.version, k, flt)
        log.debug("retrieved %d ads in %.2f ms", len(hits.ad_ids), 1e3 * (time.perf_counter() - t0))
        return hits, query


def retrieval_block(hits: Retrieved, query: Query, ms: float) -> dict:
    """What the answer says about the retrieval stage: which index and version, how the ads were found."""
    return {
        "stage": "retrieve -> rank",  # retrieval chose the candidates; every position is the ranker's
        "index_version": hits.model_version,
        "k": hits.k,
        "retrieved": len(hits.ad_ids),
        "eligible": hits.eligible,
        "method": hits.method,
        "short_of_k": hits.short_of_k,
        "query": query.kind,  # fresh | cached | cold_start (serving.retrieval.query)
        "query_fallback": query.fallback,  # why not fresh (None: fresh, or fresh queries off)
        "query_events": query.events,  # events the fresh query read
        "cold_start_query": query.kind == "cold_start",
        "ms": round(ms, 3),
    }
