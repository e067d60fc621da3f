"""The KServe predictor of the online ranker.

    answer   (called by ``serving.gateway`` for V1 and V2 alike, with a parsed request and a deadline)
             read the user side from Feast (worker thread, ``feature_timeout_ms``) -> online features -> tensors
             (serving.inputs) -> user K/V once, candidates in batches (``serving.request_scorer``), on the
             thread that read the store (``serving.scoring_threads``: at most ``scoring.workers`` at once) or,
             with ``scoring.processes`` > 0, a scoring worker process (``serving.scoring_processes``): the event
             loop keeps parsing and reading the next requests while torch (which releases the GIL in its
             kernels) scores this one
             a request without candidates retrieves them after the read, where it is scored: its query comes
             from the events that read returned (one read serves both; ``serving.retrieval``)
    result   ranked ad ids with p_click / p_conversion, versions, ad-table as-of, fallback flags (numpy arrays)

Deadlines: work whose deadline has passed is cancelled, not finished: a queued job never starts, a running one
stops at its next checkpoint (before the tensors, before each scoring batch). Outcomes are counted by the gateway
once an answer is actually sent (``count``), so a request answered 503 is never counted as ok.

Degradation, not failure: an unknown user or a missing/unusable embedding takes the cold-start path (profile +
recent events only); an embedding from another user-model version is flagged, counted and not used; a slow or
unavailable store answers from whatever is known (no user side at all) within the budget. Readiness means "this
replica can answer" (model and ad table loaded, a scoring process alive if they are used); the shared store's
health is a metric and a per-answer flag.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time

import torch
from kserve import Model
from kserve.errors import InvalidInput

from features.schema import SURFACES
from gemflow.workspace import Workspace
from models.inference import one_user
from serving import inputs as build
from serving import runtime
from serving.ad_refresh_process import ProcessLoader
from serving.ad_table import (
    AdTable,
    feast_ad_loader,
    offline_ad_ids,
    sqlite_version,
    store_ad_loader,
)
from serving.config import ServingConfig
from serving.feature_log import LOGGED, FeatureLog
from serving.id_rows import IdRows
from serving.model_source import ServedModel, load_served_model
from serving.pauses import PauseMonitor
from serving.request_scorer import Job, RequestScorer
from serving.retrieval.eligibility import AdFilter, OfflineEligibility
from serving.retrieval.service import RetrievalService, retrieval_block
from serving.schema import ParsedRequest, RequestError, parse_request
from serving.scoring_processes import ScoringProcesses, WorkerSetup
from serving.scoring_threads import ScoringThreads
from serving.stats import ServingStats
from serving.user_features import UserFeatureReader, store_guard

log = logging.getLogger(__name__)
USER_SERVICE = "ranker_serving"
PROBE_SECONDS = 1.0  # how long a feature-store health probe result is reused
WARM_UP_READS = 64  # store reads before serving (they seed the adaptive read budget)


class RankerPredictor(Model):
    def __init__(self, cfg: ServingConfig, ws: Workspace, *, served: ServedModel | None = None, store=None):
        super().__init__(cfg.model_name)
        self.cfg, self.ws = cfg, ws
        self.served = served
        self.store = store
        self.stats = ServingStats()
        self.pauses = PauseMonitor()
        self.reader: UserFeatureReader | None = None
        self.ads: AdTable | None = None
        self._arrays: build.AdArrays | None = None
        self._probe: tuple[float, bool, str | None] = (0.0, False, None)  # (when, ok, problem kind)
        self._threads: ScoringThreads | None = None  # scoring.processes == 0
        self.scorer: RequestScorer | None = None
        self._processes: ScoringProcesses | None = None  # scoring.processes > 0
        self.retrieval: RetrievalService | None = None  # retrieval.enabled: requests without candidates
        rate = cfg.feature_log.sample_rate
        self.feature_log = FeatureLog(ws, cfg.feature_log) if rate > 0 else None

    # ------------------------------------------------------------------------------------------- lifecycle
    def load(self) -> bool:
        sc = self.cfg.scoring
        runtime.configure(sc.torch_threads, sc.gil_switch_ms)
        self.pauses.start_gc()
        if self.served is None:
            self.served = load_served_model(self.cfg.model_uri, self.cfg.tracking_uri, self.ws)
        # with worker processes, this process picks the variant (timed here) and each worker compiles that one
        if sc.torchscript and not self.served.ranker.script_one_user():
            log.info("the ranker's one-user path does not apply to this model: candidates are scored eagerly")
        self.scorer = RequestScorer(self.served, self.name, sc.batch_size, int(sc.cache_mb * 2**20),
                                    self.expected_user_model_version)  # fmt: skip
        if sc.processes:
            setup = WorkerSetup(self.cfg.model_uri, self.cfg.tracking_uri, str(self.ws.root), self.name, sc.batch_size,
                                int(sc.cache_mb * 2**20), self.expected_user_model_version, sc.torchscript,
                                min(self.cfg.limits.max_candidates, sc.batch_size), self._one_user_variant())  # fmt: skip
            self._processes = ScoringProcesses(setup, sc.processes)
            log.info("scoring in %d worker processes", sc.processes)
        else:
            self._threads = ScoringThreads(sc.workers, sc.torch_threads, self.rank, sc.inline)
        if self.store is None:
            from features.store import open_store

            self.store = open_store(self.ws, self.cfg.feature_store)
        lim, at = self.cfg.limits, self.cfg.ad_table
        guard = store_guard(self.store)  # one per store: user reads and ad-table refreshes share it
        self.reader = UserFeatureReader(
            self.store,
            USER_SERVICE,
            lim.feature_timeout_ms / 1e3,
            sc.feature_workers,
            sc.feature_waiting,
            guard,
            lim.feature_timeout_max_ms / 1e3,
            continuation_threads=0 if sc.processes else sc.workers,  # reading threads go on to score
            thread_init=functools.partial(runtime.worker_init, sc.torch_threads),
        )
        here = feast_ad_loader(self.store, offline_ad_ids(self.ws), at.feature_service, at.lookup_chunk, guard,
                               sqlite_version(self.store))  # fmt: skip
        if at.refresh_process:  # its own store handle from the same config, no GIL shared with requests
            make = functools.partial(store_ad_loader, self.ws, self.cfg.feature_store, at.feature_service,
                                     at.lookup_chunk)  # fmt: skip
            loader = ProcessLoader(make, timeout_s=max(at.refresh_seconds, 60.0))
            self.ads = AdTable(loader, at.refresh_seconds, initial_loader=here,  # first load: no child wait
                               max_failures=at.max_refresh_failures)  # fmt: skip
        else:
            self.ads = AdTable(here, at.refresh_seconds, max_failures=at.max_refresh_failures)
        self.ads.start()
        if self.cfg.retrieval.enabled:
            self.retrieval = RetrievalService(self.cfg.retrieval, self.ws, OfflineEligibility(self.ws),
                                              self.cfg.tracking_uri)  # fmt: skip
            self.retrieval.start()
        self._warm_up()
        self.ready = True  # the model is loaded: requests are served (degraded if the store is down)
        log.info(
            "ranker %s loaded from %s (expects user model %r); ad table: %s",
            self.served.version, self.served.uri, self.expected_user_model_version, self.ads.status(),
        )  # fmt: skip
        return self.ready

    def stop(self) -> None:
        self.pauses.stop()
        if self.ads:
            self.ads.stop()
        if self.reader:
            self.reader.close()
        if self._threads:
            self._threads.close()
        if self._processes:
            self._processes.close()
        if self.feature_log:
            self.feature_log.close()
        if self.retrieval:
            self.retrieval.stop()
        super().stop()

    @property
    def expected_user_model_version(self) -> str:
        return self.cfg.expected_user_model_version or (self.served.user_model_version if self.served else "")

    def _one_user_variant(self) -> str | None:
        """The one-user scorer variant this process chose, for its worker processes (None: not scripted)."""
        scorer = self.served.ranker.one_user_scorer()
        return one_user.variant_of(scorer) if isinstance(scorer, torch.jit.ScriptModule) else None

    def _warm_up(self) -> None:
        """Read the store a few times (first reads are slow; they also seed the adaptive read budget) and score
        throwaway full-size requests on every thread that scores (``RequestScorer.warm_up``: the reading threads,
        the scoring pool and, with ``scoring.inline``, this one; worker processes warm up on their own)."""
        self.reader.warm_up(0, WARM_UP_READS)
        if self._processes is not None:
            self._processes.prime(self.ad_arrays())
            return
        size = min(self.cfg.limits.max_candidates, self.cfg.scoring.batch_size)
        warm = functools.partial(self.scorer.warm_up, self.ad_arrays(), size, 2)
        self.reader.on_every_thread(warm)
        self._threads.on_every_thread(warm)
        if self.cfg.scoring.inline:  # the event loop's thread (this one) scores too
            warm()

    def ad_arrays(self) -> build.AdArrays:
        """The current ad snapshot as model-ready arrays (rebuilt only when the background refresh swapped it)."""
        snap = self.ads.snapshot
        if self._arrays is None or self._arrays.snapshot is not snap:
            self._arrays = build.AdArrays.build(snap, self.served.dense, IdRows.of(self.served.vocabularies))
            if self._arrays.missing_columns:
                log.warning("ad table lacks trained dense column(s) %s", self._arrays.missing_columns)
        return self._arrays

    # ------------------------------------------------------------------------------------------- health
    async def readiness(self) -> tuple[bool, dict]:
        """Ready = model loaded AND ad table loaded and not stale (``ad_table.max_refresh_failures``) AND a scoring
        process alive: this replica can answer. The shared online store is not part
        of it (an outage would unroute every replica exactly when the degraded path should answer); its health
        is reported here, in ``/metrics`` and in every answer's fallback flags."""
        now = time.monotonic()
        at, ok, why = self._probe
        if now - at > PROBE_SECONDS and self.reader is not None:  # no request read the store lately: probe it
            _, problem = await self.reader.read(0)
            self._note_store(problem)
            _, ok, why = self._probe
        ads = self.ads.status() if self.ads else {"loaded": False}
        workers = None if self._processes is None else self._processes.alive
        ready = bool(self.ready and ads.get("loaded") and not ads.get("stale") and workers != 0)
        detail = {
            "name": self.name,
            "ready": ready,
            "model_loaded": self.ready,
            "model_version": self.served.version if self.served else None,
            "expected_user_model_version": self.expected_user_model_version,
            "feature_store": {
                "ok": ok,
                "problem": why,
                "read_budget_ms": round(1e3 * self.reader.timeout_s, 3) if self.reader else None,
            },
            "ad_table": ads,
        }
        if workers is not None:
            detail["scoring_processes_alive"] = workers
        return ready, detail

    def _note_store(self, problem: str | None) -> None:
        """Record the store's health from a read. Clients see only the problem's kind; its text (an exception
        message may name hosts) goes to the log, once per change of state."""
        kind = None if problem is None else problem.split(":", 1)[0]
        if kind != self._probe[2]:
            log.warning("feature store: %s", problem or "reads succeed again")
        self._probe = (time.monotonic(), problem is None, kind)
        self.stats.store(problem is None)

    # ------------------------------------------------------------------------------------------- handlers
    async def answer(self, req: ParsedRequest, deadline: float) -> dict:
        """Rank one parsed request; raises Cancelled past ``deadline`` (and stops its worker, see ``Job``)."""
        sampled = self.feature_log is not None and random.random() < self.cfg.feature_log.sample_rate
        result = await self._answer(req, deadline, sampled)
        row = result.pop(LOGGED, None)
        if row is not None:
            self.feature_log.add(row)
        return result

    async def _answer(self, req: ParsedRequest, deadline: float, log_features: bool) -> dict:
        if req.retrieve_k is not None and self.retrieval is None:
            raise RequestError(
                "retrieve: this server does not retrieve candidates (retrieval.enabled is off)"
            )
        return await self._ranked(req, deadline, log_features)

    def _retrieve(self, job: Job) -> tuple[dict, dict[int, int]]:
        """Fill ``job.req.candidates`` from the index, with the query from the user side ``job`` read (the ranker's
        read: one per request) under the ranker's cutoff; (the answer's retrieval block, ad -> retrieval position).
        Runs where the request is scored (a reading or scoring thread: FAISS and torch release the GIL)."""
        job.check()
        t0 = time.perf_counter()
        req = job.req
        if req.request_ts is None:  # one clock for the query's events and the ranker's
            req.request_ts = time.time()
        flt = AdFilter(SURFACES[req.surface], req.exclude_advertisers)
        hits, query = self.retrieval.retrieve(req.user_id, req.retrieve_k, flt, job.feats, req.request_ts,
                                              self.served.cfg.fresh_delay_s)  # fmt: skip
        if not len(hits.ad_ids):
            raise RequestError(f"retrieve: no ad is eligible ({hits.short_of_k})")
        req.candidates = hits.ad_ids
        return retrieval_block(hits, query, 1e3 * (time.perf_counter() - t0)), {
            int(a): i for i, a in enumerate(hits.ad_ids.tolist())
        }

    async def _ranked(self, req: ParsedRequest, deadline: float, log_features: bool) -> dict:
        started = time.perf_counter()
        self.pauses.watch_loop()  # the lag probe needs the server's running loop: started by the first request
        if self._threads is not None:
            job = Job(req, None, None, started, 0.0, deadline, log_features=log_features)
            try:
                return await self._threads.answer(self.reader, job)
            finally:
                if job.fetch_ms:  # the read is over (or was given up on): every read is also a health probe
                    self._note_store(job.store_problem)
        feats, problem = await self.reader.read(req.user_id)
        self._note_store(problem)
        job = Job(req, feats, problem, started, 1e3 * (time.perf_counter() - started), deadline,
                  log_features=log_features)  # fmt: skip
        job.check()
        retrieved = None if req.retrieve_k is None else await asyncio.to_thread(self._retrieve, job)
        result = await self._processes.rank(job, self.ad_arrays(), self.ads.loaded)
        return with_retrieval(result, retrieved)

    def inline_answers(self) -> int:
        """Requests read and scored on the event loop (``scoring.inline``) since the start."""
        return 0 if self._threads is None else self._threads.inlined

    def count(self, result: dict) -> None:
        """Count an answer that was sent (called by the gateway after a 200)."""
        fb = result["fallback"]
        self.stats.unknown(fb["unknown_ads"])
        if fb["embedding_version_mismatch"]:
            self.stats.version_mismatch()
        for reason in fb["reasons"]:
            self.stats.fallback(reason)
        if "retrieval" in result:
            self.stats.retrieval_query(result["retrieval"]["query"], result["retrieval"]["query_fallback"])
        self.stats.request("degraded" if fb["degraded"] else "ok")

    async def predict(self, payload, headers=None):
        """KServe's ``Model.predict``, V1 only: what KServe's own data plane would call. The server routes no
        inference here (``serving.gateway`` answers both protocols with its limits, deadline and error shapes);
        ``bench/kserve_path.py`` serves through it to compare KServe's public path with ours."""
        if not isinstance(payload, dict):
            raise InvalidInput("this predictor answers V1 payloads; V2 is served by serving.gateway")
        lim = self.cfg.limits
        now = time.time()
        bounds = (now - 86400 * lim.request_ts_max_age_days, now + lim.request_ts_max_ahead_s)
        try:
            req = parse_request(payload, lim.max_candidates, bounds)
        except RequestError as err:
            raise InvalidInput(str(err)) from None
        result = await self.answer(req, time.monotonic() + lim.request_timeout_ms / 1e3)
        self.count(result)
        result = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in result.items()}  # FastAPI's JSON
        return {"predictions": [result]} if req.wrapped else result

    def rank(self, job: Job) -> dict:
        """The retrieval (requests without candidates) and scoring of one request (on a reading or scoring thread,
        ``serving.scoring_threads``)."""
        retrieved = None if job.req.retrieve_k is None else self._retrieve(job)
        return with_retrieval(self.scorer.rank(job, self.ad_arrays(), self.ads.loaded), retrieved)


def with_retrieval(result: dict, retrieved: tuple[dict, dict[int, int]] | None) -> dict:
    """The ranked answer with what retrieval found: its block, and each ad's position before ranking."""
    if retrieved is not None:
        block, order = retrieved
        result["retrieval"] = block
        result["retrieval_rank"] = [order[a] for a in result["ad_ids"].tolist()]
    return result
