"""Serving counters: Prometheus metrics (scraped at ``/metrics`` next to KServe's own) and a JSON snapshot
(``GET /v2/models/{name}/stats``) for humans, tests and the load bench."""

from __future__ import annotations

import threading
from collections import Counter

from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge

REQUESTS = PromCounter("gemflow_ranker_requests", "Ranking requests by outcome", ["outcome"])
FALLBACKS = PromCounter("gemflow_ranker_fallbacks", "Degraded answers by reason", ["reason"])
VERSION_MISMATCH = PromCounter(
    "gemflow_ranker_embedding_version_mismatch", "Cached embeddings written by another user-model version"
)
UNKNOWN_ADS = PromCounter("gemflow_ranker_unknown_ads", "Candidates missing from the in-process ad table")
RESPONSES = PromCounter(
    "gemflow_ranker_http_responses",
    "Every HTTP response of the serving process by route and status",
    ["route", "code"],
)
SHED = PromCounter(
    "gemflow_ranker_shed", "Requests refused or cancelled without an answer, by reason", ["reason"]
)
STORE_UP = Gauge(
    "gemflow_ranker_feature_store_up", "1 when the last online-store read succeeded in its budget"
)
DEGRADED = Gauge(
    "gemflow_ranker_degraded_fraction",
    "Share of degraded answers among the last ~1,000 (exponential average)",
)
DEGRADED_ALPHA = 1e-3  # ~1,000-answer memory: one bad second at 100 req/s shows, a single outlier does not


class ServingStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.version_mismatches = 0
        self.unknown_ads = 0
        self.responses: Counter[str] = Counter()
        self.shed: Counter[str] = Counter()
        self.degraded_fraction = 0.0
        self.store_up = False
        self.phase_ms: Counter[str] = Counter()  # summed wall ms per phase of answered requests
        self.answered = 0

    def request(self, outcome: str) -> None:
        """One answered ranking request: ``ok`` / ``degraded`` (sent 200), ``rejected`` (4xx)."""
        REQUESTS.labels(outcome=outcome).inc()
        with self._lock:
            self.outcomes[outcome] += 1
            if outcome in ("ok", "degraded"):
                hit = float(outcome == "degraded")
                self.degraded_fraction += DEGRADED_ALPHA * (hit - self.degraded_fraction)
                DEGRADED.set(self.degraded_fraction)

    def response(self, route: str, code: int) -> None:
        RESPONSES.labels(route=route, code=str(code)).inc()
        with self._lock:
            self.responses[f"{route} {code}"] += 1

    def shed_one(self, reason: str) -> None:
        SHED.labels(reason=reason).inc()
        with self._lock:
            self.shed[reason] += 1

    def phases(self, **ms: float) -> None:
        """One answered request's wall time per phase (parse, features, build, score, encode, total)."""
        with self._lock:
            self.answered += 1
            self.phase_ms.update(ms)

    def model_stats(self, name: str, version: str) -> dict:
        """The Open Inference Protocol statistics extension's shape (as Triton answers
        ``GET /v2/models/{name}/stats``): counts and summed nanoseconds per phase."""
        with self._lock:
            ns = {k: int(v * 1e6) for k, v in self.phase_ms.items()}
            n = self.answered
            failed = sum(v for k, v in self.outcomes.items() if k not in ("ok", "degraded"))
        d = lambda count, key: {"count": count, "ns": ns.get(key, 0)}  # noqa: E731
        return {"model_stats": [{
            "name": name, "version": version, "inference_count": n, "execution_count": n,
            "inference_stats": {
                "success": d(n, "total"), "fail": {"count": failed, "ns": 0}, "queue": d(n, "queue"),
                "compute_input": {"count": n, "ns": ns.get("parse", 0) + ns.get("features", 0) + ns.get("build", 0)},
                "compute_infer": d(n, "score"), "compute_output": d(n, "encode"),
            },
        }]}  # fmt: skip

    def store(self, up: bool) -> None:
        self.store_up = up
        STORE_UP.set(float(up))

    def fallback(self, reason: str) -> None:
        key = reason.split(":", 1)[0]  # bounded label set: the reason's kind, not its message
        FALLBACKS.labels(reason=key).inc()
        with self._lock:
            self.fallbacks[key] += 1

    def version_mismatch(self) -> None:
        VERSION_MISMATCH.inc()
        with self._lock:
            self.version_mismatches += 1

    def unknown(self, count: int) -> None:
        if count:
            UNKNOWN_ADS.inc(count)
            with self._lock:
                self.unknown_ads += count

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "requests": dict(self.outcomes),
                "fallbacks": dict(self.fallbacks),
                "embedding_version_mismatches": self.version_mismatches,
                "unknown_ads": self.unknown_ads,
                "responses": dict(self.responses),
                "shed": dict(self.shed),
                "degraded_fraction": round(self.degraded_fraction, 6),
                "feature_store_up": self.store_up,
                "answered": self.answered,
                "phase_ms_sum": {k: round(v, 3) for k, v in self.phase_ms.items()},
            }
