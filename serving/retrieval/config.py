"""Retrieval settings: plain dataclasses (the serving config imports them without FAISS or torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

INDEX_KINDS = ("auto", "exact", "hnsw", "ivf")


@dataclass
class IndexConfig:
    kind: str = "auto"  # auto (exact under exact_under ads, ivf above) | exact | hnsw | ivf
    exact_under: int = 100_000
    hnsw_m: int = 32  # graph degree (memory: ~2 * M * 4 bytes per ad on top of its vector)
    ef_construction: int = 80
    ef_search: int = 1200  # HNSW beam; at least K is used
    ivf_lists: int = 0  # k-means cells; 0 = 4 * sqrt(ads)
    nprobe: int = 100  # IVF cells searched per query (unfiltered)
    max_k: int = 5000  # the largest K a request may ask for
    default_k: int = 1000
    exact_below: float = 0.05  # a filter keeping less than this share of the catalog: its ads scored exactly
    max_widen: float = 20.0  # a filter widens the beam by at most this factor

    def resolved_kind(self, ads: int) -> str:
        if self.kind != "auto":
            return self.kind
        return "exact" if ads < self.exact_under else "ivf"

    def validate(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise ValueError(f"retrieval index kind must be one of {INDEX_KINDS}, got {self.kind!r}")
        if min(self.hnsw_m, self.ef_construction, self.ef_search, self.nprobe, self.max_k) < 1:
            raise ValueError("hnsw_m, ef_construction, ef_search, nprobe and max_k must be >= 1")
        if not 1 <= self.default_k <= self.max_k:
            raise ValueError(f"default_k {self.default_k} must be within 1..max_k ({self.max_k})")


@dataclass
class RetrievalConfig:
    enabled: bool = False
    folder: str = ""  # a folder with ad_vectors.parquet + user_queries.parquet; "" = the newest refresh's
    reload_seconds: float = 0.0  # look for a newer refresh this often; 0 = load once at start
    # the query from the user model over the events the request read (else the refresh's cached query): the
    # server loads the user model the refresh folder records (serving.retrieval.query)
    fresh_query: bool = True
    # FAISS (OpenMP) threads per search: one query is too small to split, and spinning OpenMP workers beside the
    # scoring threads slowed an exact 20k-ad search ~20x on a loaded 2-core machine (bench/retrieval_http.py)
    search_threads: int = 1
    index: IndexConfig = field(default_factory=IndexConfig)

    def validate(self) -> None:
        self.index.validate()
        if self.search_threads < 1:
            raise ValueError(f"retrieval.search_threads must be >= 1, got {self.search_threads}")
        if self.reload_seconds < 0:
            raise ValueError(f"retrieval.reload_seconds must be >= 0, got {self.reload_seconds}")
