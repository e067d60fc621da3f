"""Serving counters: Prometheus metrics (scraped at ``/metrics`` next to KServe's own) and a JSON snapshot
(``GET /v2/models/{name}/stats``) for humans, tests and the load bench."""

from __future__ import annotations

import threading
from collections import Counter

from prometheus_client import Counter as PromCounter

REQUESTS = PromCounter("gemflow_ranker_requests", "Ranking requests by outcome", ["outcome"])
FALLBACKS = PromCounter("gemflow_ranker_fallbacks", "Degraded answers by reason", ["reason"])
VERSION_MISMATCH = PromCounter(
    "gemflow_ranker_embedding_version_mismatch", "Cached embeddings written by another user-model version"
)
UNKNOWN_ADS = PromCounter("gemflow_ranker_unknown_ads", "Candidates missing from the in-process ad table")


class ServingStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.version_mismatches = 0
        self.unknown_ads = 0

    def request(self, outcome: str) -> None:
        REQUESTS.labels(outcome=outcome).inc()
        with self._lock:
            self.outcomes[outcome] += 1

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
            }
