"""Serving counters: Prometheus metrics (scraped at ``/metrics`` next to KServe's own) and a JSON snapshot
(``GET /v2/models/{name}/stats``) for humans, tests and the load bench.

The metrics are the only record: the snapshot is read back from them. With ``server_processes`` > 1 every server
process writes them to the shared ``$PROMETHEUS_MULTIPROC_DIR`` (``serving.server_processes``), and the snapshot
and ``/metrics`` of any process sum them over all of them: a client counts what the whole server answered, whichever
process it reached.
"""

from __future__ import annotations

import os
import threading

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Gauge, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.multiprocess import MultiProcessCollector

REQUESTS = PromCounter("gemflow_ranker_requests", "Ranking requests by outcome", ["outcome"])
FALLBACKS = PromCounter("gemflow_ranker_fallbacks", "Degraded answers by reason", ["reason"])
VERSION_MISMATCH = PromCounter(
    "gemflow_ranker_embedding_version_mismatch", "Cached embeddings written by another user-model version"
)
RETRIEVAL_VERSION_MISMATCH = PromCounter(
    "gemflow_retrieval_version_mismatch",
    "Retrieval queries refused: the index holds another user-model version",
)
RETRIEVAL_QUERIES = PromCounter(
    "gemflow_retrieval_queries",
    "Retrieval queries of answered requests by kind (fresh, cached, cold_start)",
    ["query"],
)
RETRIEVAL_QUERY_FALLBACKS = PromCounter(
    "gemflow_retrieval_query_fallbacks",
    "Answered retrieval requests whose fresh query could not be computed, by reason (serving.retrieval.query)",
    ["reason"],
)
UNKNOWN_ADS = PromCounter("gemflow_ranker_unknown_ads", "Candidates missing from the in-process ad table")
RESPONSES = PromCounter(
    "gemflow_ranker_http_responses",
    "Every HTTP response of the server by route and status",
    ["route", "code"],
)
SHED = PromCounter(
    "gemflow_ranker_shed", "Requests refused or cancelled without an answer, by reason", ["reason"]
)
ANSWERED = PromCounter("gemflow_ranker_answered", "Ranking requests answered with scores (200)")
PHASE_MS = PromCounter(
    "gemflow_ranker_phase_ms", "Summed wall milliseconds of answered requests per phase", ["phase"]
)
CHILD_DEATHS = PromCounter(
    "gemflow_ranker_child_deaths",
    "Child processes of the server that died, by kind (ad_refresh, scoring)",
    ["child"],
)
CHILD_RESTARTS = PromCounter(
    "gemflow_ranker_child_restarts", "Child processes started again after one died, by kind", ["child"]
)
AD_REFRESHES = PromCounter(
    "gemflow_ranker_ad_table_refreshes",
    "Ad-table refreshes by outcome (loaded, unchanged, failed)",
    ["outcome"],
)
# (multiprocess_mode: how the server processes' values combine; ignored with one process)
AD_REFRESH_FAILING = Gauge(
    "gemflow_ranker_ad_table_failed_refreshes_in_a_row",
    "Consecutive failed ad-table refreshes (0 after a success; the worst server process)",
    multiprocess_mode="livemax",
)
STORE_UP = Gauge(
    "gemflow_ranker_feature_store_up",
    "1 when the last online-store read succeeded in its budget (the worst server process)",
    multiprocess_mode="livemin",
)
DEGRADED = Gauge(
    "gemflow_ranker_degraded_fraction",
    "Share of degraded answers among the last ~1,000 (exponential average; the worst server process)",
    multiprocess_mode="livemax",
)
DEGRADED_ALPHA = 1e-3  # ~1,000-answer memory: one bad second at 100 req/s shows, a single outlier does not


# Set by ``serving.server_processes``' supervisor next to ``$PROMETHEUS_MULTIPROC_DIR``: that variable alone does not
# mean this server shares its metrics. Feast sets it to a temporary folder when it is imported (``feast.metrics``),
# and every process started from one that imported Feast inherits that folder: two servers started by one parent (a
# test session, a DAG task) summed each other's counts.
SHARED_METRICS_ENV = "GEMFLOW_SERVER_PROCESSES_METRICS"


def multiprocess() -> bool:
    """Whether this process is one of several server processes sharing their metrics."""
    return bool(os.environ.get(SHARED_METRICS_ENV)) and bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def registry() -> CollectorRegistry:
    """The metrics of the whole server: this process's, or every server process's summed."""
    if not multiprocess():
        return REGISTRY
    merged = CollectorRegistry()
    MultiProcessCollector(merged)
    return merged


def exposition() -> tuple[bytes, str]:
    """``/metrics`` of the whole server: the body (Prometheus text format) and its content type."""
    return generate_latest(registry()), CONTENT_TYPE_LATEST


class ServingStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._degraded = 0.0  # this process's exponential average (DEGRADED)

    def request(self, outcome: str) -> None:
        """One answered ranking request: ``ok`` / ``degraded`` (sent 200), ``rejected`` (4xx)."""
        REQUESTS.labels(outcome=outcome).inc()
        if outcome in ("ok", "degraded"):
            with self._lock:
                self._degraded += DEGRADED_ALPHA * (float(outcome == "degraded") - self._degraded)
                DEGRADED.set(self._degraded)

    def response(self, route: str, code: int) -> None:
        RESPONSES.labels(route=route, code=str(code)).inc()

    def shed_one(self, reason: str) -> None:
        SHED.labels(reason=reason).inc()

    def phases(self, **ms: float) -> None:
        """One answered request's wall time per phase (parse, features, build, score, encode, total)."""
        ANSWERED.inc()
        for phase, value in ms.items():
            PHASE_MS.labels(phase=phase).inc(value)

    def store(self, up: bool) -> None:
        STORE_UP.set(float(up))

    def fallback(self, reason: str) -> None:
        FALLBACKS.labels(reason=reason.split(":", 1)[0]).inc()  # bounded label set: the reason's kind

    def version_mismatch(self) -> None:
        VERSION_MISMATCH.inc()

    def retrieval_query(self, kind: str, fallback: str | None) -> None:
        RETRIEVAL_QUERIES.labels(query=kind).inc()
        if fallback:
            RETRIEVAL_QUERY_FALLBACKS.labels(reason=fallback).inc()

    def unknown(self, count: int) -> None:
        if count:
            UNKNOWN_ADS.inc(count)

    def snapshot(self) -> dict:
        """The whole server's counts, read back from the metrics."""
        samples: dict[str, list] = {}
        for family in registry().collect():
            if family.name.startswith(("gemflow_ranker_", "gemflow_retrieval_")):
                samples[family.name] = [s for s in family.samples if not s.name.endswith("_created")]

        def by(
            name: str, *labels: str
        ) -> dict[str, float]:  # label values joined by a space ("v1_predict 200")
            return {" ".join(s.labels[k] for k in labels): s.value for s in samples.get(name, [])}

        def count(name: str, *labels: str) -> dict[str, int]:
            return {k: int(v) for k, v in by(name, *labels).items()}

        def one(name: str) -> float:
            return sum(s.value for s in samples.get(name, []))

        return {
            "requests": count("gemflow_ranker_requests", "outcome"),
            "fallbacks": count("gemflow_ranker_fallbacks", "reason"),
            "embedding_version_mismatches": int(one("gemflow_ranker_embedding_version_mismatch")),
            "unknown_ads": int(one("gemflow_ranker_unknown_ads")),
            "child_deaths": count("gemflow_ranker_child_deaths", "child"),
            "child_restarts": count("gemflow_ranker_child_restarts", "child"),
            "ad_table_refreshes": count("gemflow_ranker_ad_table_refreshes", "outcome"),
            "responses": count("gemflow_ranker_http_responses", "route", "code"),
            "shed": count("gemflow_ranker_shed", "reason"),
            "degraded_fraction": round(one("gemflow_ranker_degraded_fraction"), 6),
            "feature_store_up": bool(one("gemflow_ranker_feature_store_up")),
            "answered": int(one("gemflow_ranker_answered")),
            "phase_ms_sum": {k: round(v, 3) for k, v in by("gemflow_ranker_phase_ms", "phase").items()},
            "retrieval": {
                "queries": count("gemflow_retrieval_queries", "query"),
                "query_fallbacks": count("gemflow_retrieval_query_fallbacks", "reason"),
                "version_mismatches": int(one("gemflow_retrieval_version_mismatch")),
            },
        }

    def model_stats(self, name: str, version: str) -> dict:
        """The Open Inference Protocol statistics extension's shape (as Triton answers
        ``GET /v2/models/{name}/stats``): counts and summed nanoseconds per phase."""
        snap = self.snapshot()
        ns = {k: int(v * 1e6) for k, v in snap["phase_ms_sum"].items()}
        n = snap["answered"]
        failed = sum(v for k, v in snap["requests"].items() if k not in ("ok", "degraded"))
        d = lambda count, key: {"count": count, "ns": ns.get(key, 0)}  # noqa: E731
        return {"model_stats": [{
            "name": name, "version": version, "inference_count": n, "execution_count": n,
            "inference_stats": {
                "success": d(n, "total"), "fail": {"count": failed, "ns": 0}, "queue": d(n, "queue"),
                "compute_input": {"count": n, "ns": ns.get("parse", 0) + ns.get("features", 0) + ns.get("build", 0)},
                "compute_infer": d(n, "score"), "compute_output": d(n, "encode"),
            },
        }]}  # fmt: skip
