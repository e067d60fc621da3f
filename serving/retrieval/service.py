"""Retrieval inside the ranker server: the current index + user queries, swapped whole, and the one call a request
makes (``retrieve``).

A ``Snapshot`` is everything one user-model version needs to retrieve: the ANN index over its ad vectors and its
users' queries (both from one ``offline/retrieval/D`` folder that the embedding refresh wrote). The service holds
one reference to the current snapshot; a reload builds the next one completely off to the side and swaps the
reference in one assignment, so a request (which takes the reference once) is answered wholly from one complete
index, old or new, never from a half-built one. Reloads run on a background thread every ``reload_seconds``
when a newer folder (or a newer version) appears.

A user without a query of this version (not refreshed yet) is retrieved for by the catalog's mean user query
(a cold-start list, flagged in the answer), not refused: the ranker still orders what comes back.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from features.feature_repo.offline import partition_days
from gemflow.workspace import Workspace
from models.embeddings.ad_vectors import (
    AD_VECTOR_FILE,
    RETRIEVAL_TABLE,
    USER_QUERY_FILE,
    UserQueries,
    read_ad_vectors,
)
from serving.retrieval.config import IndexConfig, RetrievalConfig
from serving.retrieval.eligibility import AdFilter, OfflineEligibility
from serving.retrieval.index import AdIndex, Retrieved, build_index
from serving.retrieval.index_files import current_index, index_meta, load_index

log = logging.getLogger(__name__)


class RetrievalUnavailable(RuntimeError):
    """This server has no retrieval index (disabled, or none loaded yet): answered 503."""


@dataclass(frozen=True)
class Snapshot:
    index: AdIndex
    queries: UserQueries
    source: str  # what it was built from: the refresh folder, and the index build it mapped (``source_key``)
    cold_query: np.ndarray  # the mean user query: what a user without one retrieves with
    eligibility_key: str = ""  # the eligibility tables it read (``OfflineEligibility.key``)

    @property
    def version(self) -> str:
        return self.index.model_version


def source_key(folder: Path) -> str:
    """The refresh folder and its current index build: a new build of the same folder is a new source."""
    built = current_index(folder)
    return f"{folder}#{built.name if built else 'built-here'}"


def build_snapshot(folder: Path, cfg: IndexConfig, eligibility: OfflineEligibility | None = None) -> Snapshot:
    """Index + queries of one refresh folder; their versions must agree (one refresh writes both). The index is
    the folder's current build, memory-mapped, when one of the configured kind is there; else built here."""
    key = source_key(folder)
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
        raise ValueError(
            f"{folder}: user queries of {queries.model_version!r} beside ad vectors of {index.model_version!r}"
        )
    cold = queries.vectors.mean(0) if len(queries.vectors) else np.zeros(index.dim, np.float32)
    snap = Snapshot(index, queries, key, cold.astype(np.float32))
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
    def __init__(self, cfg: RetrievalConfig, ws: Workspace, eligibility: OfflineEligibility | None = None):
        cfg.validate()
        self.cfg, self.ws = cfg, ws
        self.eligibility = eligibility  # paused ads, surfaces, advertisers; None: every ad everywhere
        self._current: Snapshot | None = None
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

    def load(self) -> bool:
        """Build and swap in the newest refresh's snapshot if it differs from the current one."""
        folder = self.source()
        if folder is None:
            log.warning("retrieval: no refresh has written %s yet", RETRIEVAL_TABLE)
            return False
        current = self._current
        if current is not None and current.source == source_key(folder):
            if self.eligibility is None or current.eligibility_key == self.eligibility.key():
                return False
            self.swap(with_eligibility(current, self.eligibility))  # the ad tables changed: same index
            return True
        self.swap(build_snapshot(folder, self.cfg.index, self.eligibility))
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

    def retrieve(self, user_id: int, k: int, flt: AdFilter) -> tuple[Retrieved, bool]:
        """(the ``k`` best eligible ads for the user, whether the cold-start query was used)."""
        snap = self._current  # once: the whole request uses this snapshot
        if snap is None:
            raise RetrievalUnavailable("retrieval is enabled but no index is loaded yet")
        query = snap.queries.lookup(user_id)
        cold = query is None
        t0 = time.perf_counter()
        hits = snap.index.search(snap.cold_query if cold else query, snap.queries.model_version, k, flt)
        log.debug("retrieved %d ads in %.2f ms", len(hits.ad_ids), 1e3 * (time.perf_counter() - t0))
        return hits, cold


def retrieval_block(hits: Retrieved, cold: bool, ms: float) -> dict:
    """What the answer says about the retrieval stage: which index and version, how the ads were found."""
    return {
        "stage": "retrieve -> rank",  # retrieval chose the candidates; every position is the ranker's
        "index_version": hits.model_version,
        "k": hits.k,
        "retrieved": len(hits.ad_ids),
        "eligible": hits.eligible,
        "method": hits.method,
        "short_of_k": hits.short_of_k,
        "cold_start_query": cold,
        "ms": round(ms, 3),
    }
