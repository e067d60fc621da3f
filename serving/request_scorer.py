"""Scoring one admitted request: user features -> model inputs -> probabilities -> the ranked answer.

``RequestScorer.rank`` is the work of a scoring worker, wherever it runs: a thread of the server process
(``scoring.processes`` = 0) or a scoring worker process (``serving.scoring_processes``). It touches nothing of the
server but what it is given: the served model, the current ad arrays, its candidate cache.

Deadlines: ``Job.check`` is a cancellation point (before the tensors, before each scoring batch): work whose
deadline passed, or whose client was answered already, raises ``Cancelled`` instead of finishing.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

import numpy as np

from features.schema import SURFACE_ID
from serving import inputs as build
from serving.candidate_cache import CandidateCache
from serving.feature_log import LOGGED, served_row
from serving.model_source import ServedModel
from serving.schema import ParsedRequest
from serving.scorer import UserInputs, score_shared, user_tokens
from serving.user_features import UserFeatures

# Request ids: a random per-process prefix + a counter (unique without a urandom syscall per request).
_ID_PREFIX, _ID_COUNTER = os.urandom(4).hex(), itertools.count()


def _request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


class Cancelled(Exception):
    """The request's deadline passed (or its client was answered 503) before the work finished."""


@dataclass
class Job:
    """One request on its way to a scoring worker (picklable: it may cross to a worker process)."""

    req: ParsedRequest
    feats: UserFeatures | None
    store_problem: str | None
    started: float  # perf_counter at arrival (CLOCK_MONOTONIC: the same clock in every process)
    fetch_ms: float
    deadline: float  # time.monotonic() past which the work is abandoned
    cancelled: bool = False  # set by the event loop when the waiting client gave up (worker threads only)
    log_features: bool = False  # sampled for the served-feature log (``serving.feature_log``)
    request_id: str = field(default_factory=_request_id)

    def check(self) -> None:
        """A cancellation point: raises Cancelled once the work is no longer wanted."""
        if self.cancelled or time.monotonic() > self.deadline:
            raise Cancelled


class RequestScorer:
    """The served model, its candidate cache and the scoring settings: ``rank`` answers one ``Job``."""

    def __init__(self, served: ServedModel, model_name: str, batch_size: int, cache_bytes: int,
                 expected_user_model_version: str):  # fmt: skip
        self.served, self.model_name, self.batch_size = served, model_name, batch_size
        self.cache = CandidateCache(served.ranker, cache_bytes)
        self.expected = expected_user_model_version

    def warm_up(self, ads: build.AdArrays, size: int, times: int = 1) -> None:
        """Every surface's cached candidate rows (if they fit), then ``times`` throwaway scores of ``size``
        candidates: lazy kernel initialisation, TorchScript's profiling runs, and this thread's heap grown to a
        request's working set before the first real request."""
        for surface in SURFACE_ID.values():
            self.cache.table(ads, surface)
        recent, _ = build.recent_events(None, ads, time.time(), 1, 1)
        user = UserInputs(recent, build.profile(0, None), None)
        ids = np.arange(size, dtype=np.int64)
        cands, _ = build.candidates(ids, 0, ads)
        queries = self.cache.queries(ads, 0, ids)
        for _ in range(times):
            score_shared(self.served.ranker, user, cands, self.batch_size, None, queries)

    def rank(self, job: Job, ads: build.AdArrays, ads_loaded: bool) -> dict:
        """The ranked answer of ``job`` over the ad snapshot ``ads`` (``ads_loaded``: the ad table has loaded)."""
        job.check()  # it may have waited in a queue past its deadline
        t_build = time.perf_counter()
        served, req, feats = self.served, job.req, job.feats
        reasons: list[str] = []
        if job.store_problem:
            reasons.append(job.store_problem.split(":", 1)[0])  # the kind only (messages may name hosts)
        elif feats is None or not feats.known:
            reasons.append("unknown_user")
        request_ts = req.request_ts if req.request_ts is not None else time.time()
        cfg = served.cfg
        recent, filled = build.recent_events(
            feats, ads, request_ts, cfg.recent_events, cfg.time_buckets, cfg.fresh_delay_s
        )
        tokens, why_not = user_tokens(feats.embedding if feats else None, served.ranker)
        embedding_version = feats.embedding_version if feats else None
        mismatch = False
        if tokens is not None and self.expected and embedding_version != self.expected:
            mismatch, tokens = True, None  # tokens from another model live in another space: do not use them
            reasons.append("embedding_version_mismatch")
        elif tokens is None and served.ranker.user_proj is not None and feats is not None and feats.known:
            reasons.append(why_not)
        cold_start = served.ranker.user_proj is not None and tokens is None
        # raw ids -> the model's rows (its vocabulary) and the ad table's positions; unknown ids -> OOV, flagged
        user_row, user_in_vocab = ads.id_rows.user_row(req.user_id)
        positions = ads.positions(req.candidates)
        ad_rows = build.candidate_rows(req.candidates, positions, ads)
        user = UserInputs(recent, build.profile(user_row, feats), tokens)
        # the candidates' rows from the cache where it covers them; their features only where it does not
        queries = self.cache.queries(ads, req.surface, positions)
        if queries is None:
            cands, unknown = build.candidates(positions, req.surface, ads, ad_rows)
        else:
            cands, unknown = None, ads.unknown_count(positions)
        if unknown:  # scored from the out-of-vocabulary row, all alike: the answer says so
            reasons.append("unknown_ads")
        t0 = time.perf_counter()
        build_ms = 1e3 * (t0 - t_build)
        probs = score_shared(served.ranker, user, cands, self.batch_size, job.check, queries)
        order = np.argsort(-probs[:, 0], kind="stable")
        score_ms = 1e3 * (time.perf_counter() - t0)
        snap = ads.snapshot
        answer = {
            "request_id": job.request_id,
            "user_id": req.user_id if req.user_key is None else req.user_key,
            "ad_ids": req.candidates[order]
            if req.candidate_keys is None
            else [req.candidate_keys[i] for i in order],
            "p_click": probs[order, 0],
            "p_conversion": probs[order, 1],
            "model_name": self.model_name,
            "model_version": served.version,
            "expected_user_model_version": self.expected,
            "embedding_version": embedding_version,
            "ad_table_as_of": snap.as_of.isoformat() if snap.as_of else None,
            "fallback": {
                "degraded": bool(reasons) or not ads_loaded,
                "cold_start": cold_start,
                "embedding_version_mismatch": mismatch,
                "feature_store_unavailable": job.store_problem is not None,
                "ad_table_loaded": ads_loaded,
                "unknown_ads": unknown,
                "unknown_user_id": not user_in_vocab,  # not in the model's vocabulary: its OOV row
                "unknown_ad_ids": int((ad_rows < 0).sum()),
                "recent_surfaces_filled": filled,
                "reasons": reasons,
            },
            "timing_ms": {
                "features": round(job.fetch_ms, 3),
                "build": round(build_ms, 3),
                "score": round(score_ms, 3),
                "total": round(1e3 * (time.perf_counter() - job.started), 3),
            },
        }
        if job.log_features:
            answer[LOGGED] = served_row(
                job.request_id, req.user_id, request_ts, served.version, cfg, recent, feats
            )
        return answer
