"""The ANN index over the user model's ad vectors, and the one search every caller uses.

    index = build_index(ad_vectors(bundle, "gem-user-model/3"), IndexConfig(kind="hnsw"), eligibility)
    hits = index.search(query, "gem-user-model/3", k=1000, flt=AdFilter(surface="feed"))

- **Versions**: an index carries the user-model version its vectors came from; a query from any other version is
  refused (``IndexVersionMismatch``, counted in ``gemflow_retrieval_version_mismatch``): two versions' spaces
  are unrelated, so a mixed search would return confident nonsense.
- **Kinds**: ``exact`` (FAISS flat inner product), ``hnsw`` (graph), ``ivf`` (inverted lists over k-means cells);
  ``auto`` (the default) = exact under ``exact_under`` ads (a flat scan that small costs about a millisecond),
  IVF above: on 1M ads IVF recalled more of the exact top 1,000 than HNSW, faster, at the same memory
  (docs/retrieval.md; figures in docs/benchmarks.md, ``bench/retrieval.py``).
- **Filters inside the search**: the request's eligible ads are a bitmap the search reads as FAISS's
  ``IDSelector`` (an excluded ad is never a candidate). K adjusts: the search asks for min(K, eligible ads),
  widens its beam (HNSW ``efSearch`` by 1 / the share the filter keeps, IVF ``nprobe`` by its square root), retries once wider if
  the graph or cells still gave too few, and scores the eligible ads exactly when a filter leaves fewer than
  ``exact_below`` of the catalog (a gather and one matrix-vector product: cheaper than a beam that wide), or
  when the retry still fell short (a flat scan with the selector).
  A request that cannot get K says why (``Retrieved.short_of_k``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from models.embeddings.ad_vectors import AdVectors
from serving.retrieval.config import IndexConfig
from serving.retrieval.eligibility import AdEligibility, AdFilter
from serving.schema import RequestError
from serving.stats import RETRIEVAL_VERSION_MISMATCH


class IndexVersionMismatch(RuntimeError):
    """The query and the index come from different user-model versions: refused, never mixed."""


class RetrievalParamError(RequestError):
    """A retrieval parameter out of bounds (K): a client mistake, answered 4xx."""


@dataclass(frozen=True)
class Retrieved:
    ad_ids: np.ndarray  # (<= K,) int64 raw ad ids, best first
    scores: np.ndarray  # (<= K,) float32 query . ad vector (the user model's next-item logit)
    k: int  # what was asked for
    eligible: int  # ads the filter allowed
    method: str  # how they were found: hnsw | ivf | exact (+ "_wide" after a widened retry)
    model_version: str

    @property
    def short_of_k(self) -> str | None:
        """Why fewer than K ads came back (None when K did)."""
        if len(self.ad_ids) >= self.k:
            return None
        if self.eligible < self.k:
            return f"only {self.eligible} ads are eligible under this filter (asked for {self.k})"
        return f"the index found {len(self.ad_ids)} of {self.k} eligible ads"


class AdIndex:
    """One built, immutable index: its ads, their eligibility, the version they came from.

    Built here (``build_index``) or memory-mapped from the file ``gemflow retrieval-index`` wrote
    (``serving.retrieval.index_files.load_index``): ``ann`` is the searched index, ``flat`` the exact one."""

    def __init__(self, ann, flat, ad_ids: np.ndarray, model_version: str, kind: str, cfg: IndexConfig,
                 eligibility: AdEligibility | None = None, build_seconds: float = 0.0, path: str = ""):  # fmt: skip
        cfg.validate()
        self.ann, self.flat, self.kind, self.cfg = ann, flat, kind, cfg
        self.ad_ids, self.model_version, self.dim = ad_ids, model_version, flat.d
        self.build_seconds = build_seconds
        self.path = path  # the index directory it was mapped from ("" = built in this process)
        self.load_seconds = 0.0  # mapping it (``index_files.load_index``)
        self.eligibility = eligibility or AdEligibility.everything(len(ad_ids))
        if len(self.eligibility) != len(self.ad_ids):
            raise ValueError(f"eligibility for {len(self.eligibility)} ads, index of {len(self.ad_ids)}")

    def with_eligibility(self, eligibility: AdEligibility) -> AdIndex:
        """The same index structures (shared, not copied) under another eligibility: a new ad table."""
        return AdIndex(self.ann, self.flat, self.ad_ids, self.model_version, self.kind, self.cfg, eligibility,
                       self.build_seconds, self.path)  # fmt: skip

    def __len__(self) -> int:
        return len(self.ad_ids)

    @property
    def nbytes(self) -> int:
        """Serialized size of the index structures (vectors + graph / lists), what it holds in memory (mapped from
        its files: their size, shared by every process that maps them)."""
        if self.path:
            return sum(f.stat().st_size for f in Path(self.path).iterdir())
        total = faiss.serialize_index(self.ann).nbytes
        if self.flat is not self.ann and self.kind == "ivf":
            total += faiss.serialize_index(self.flat).nbytes
        return int(total + self.ad_ids.nbytes)

    def check_k(self, k: int) -> int:
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 1 <= k <= self.cfg.max_k:
            raise RetrievalParamError(f"retrieve_k: {k!r} must be an integer within 1..{self.cfg.max_k}")
        return int(k)

    def search(
        self,
        query: np.ndarray,
        query_version: str,
        k: int,
        flt: AdFilter | None = None,
        *,
        exact: bool = False,
    ) -> Retrieved:
        """The best ``k`` eligible ads for one query vector (``exact``: the flat search, for recall checks)."""
        if query_version != self.model_version:
            RETRIEVAL_VERSION_MISMATCH.inc()
            raise IndexVersionMismatch(
                f"query from user model {query_version!r}, index built from {self.model_version!r}"
            )
        k = self.check_k(k)
        q = np.ascontiguousarray(np.asarray(query, np.float32).reshape(1, self.dim))
        mask = self.eligibility.mask(flt or AdFilter())
        eligible = int(np.count_nonzero(mask))
        want = min(k, eligible)
        if want == 0:
            return self._answer(np.zeros(0, np.float32), np.zeros(0, np.int64), k, eligible, "none")
        share = eligible / len(self)
        sel = _Selector(mask) if eligible < len(self) else None
        if (
            share < self.cfg.exact_below
        ):  # a few eligible ads: score just those (the flat scan with a selector
            return self._answer(
                *self._subset(q[0], want, mask), k, eligible, "exact"
            )  # still walks every id)
        if exact or self.kind == "exact":
            return self._answer(*self._flat(q, want, sel), k, eligible, "exact")
        # HNSW: a beam that meets as many eligible ads as an unfiltered one, 1 / share wider (sqrt lost much of
        # its recall at 10% eligible on 1M ads); IVF: sqrt(1 / share) more cells kept recall@1000 at 0.97 there,
        # where 1 / share cost 10x the time (its filtered scan checks every id: bench/retrieval.py)
        widen = min((1.0 / share) ** (0.5 if self.kind == "ivf" else 1.0), self.cfg.max_widen)
        for attempt, factor in enumerate((widen, widen * 4)):
            scores, rows = self._ann(q, want, sel, factor)
            if np.count_nonzero(rows >= 0) >= want:
                return self._answer(scores, rows, k, eligible, self.kind + ("_wide" if attempt else ""))
        return self._answer(*self._flat(q, want, sel), k, eligible, "exact")

    # ------------------------------------------------------------------------------------- internals
    def _ann(self, q, want: int, sel, factor: float):
        if self.kind == "hnsw":
            ef = max(self.cfg.ef_search, want) * factor
            params = faiss.SearchParametersHNSW(efSearch=int(ef), sel=sel.faiss if sel else None)
        else:
            nprobe = min(self.ann.nlist, math.ceil(self.cfg.nprobe * factor))
            params = faiss.SearchParametersIVF(nprobe=nprobe, sel=sel.faiss if sel else None)
        scores, rows = self.ann.search(q, want, params=params)
        return scores[0], rows[0]

    def _flat(self, q, want: int, sel):
        params = faiss.SearchParameters(sel=sel.faiss) if sel else None
        scores, rows = self.flat.search(q, want, params=params)
        return scores[0], rows[0]

    def _subset(self, q: np.ndarray, want: int, mask: np.ndarray):
        rows = np.flatnonzero(mask)
        xb = faiss.rev_swig_ptr(self.flat.get_xb(), len(self) * self.dim).reshape(len(self), self.dim)
        scores = xb[rows] @ q
        top = np.argpartition(-scores, want - 1)[:want] if want < len(rows) else np.arange(len(rows))
        top = top[np.argsort(-scores[top], kind="stable")]
        return scores[top], rows[top]

    def _answer(self, scores, rows, k: int, eligible: int, method: str) -> Retrieved:
        found = rows >= 0
        ids = self.ad_ids[rows[found]]
        return Retrieved(ids, scores[found].astype(np.float32), k, eligible, method, self.model_version)


class _Selector:
    """A request's eligibility bitmap as FAISS reads it; holds the packed bytes the selector points into."""

    def __init__(self, mask: np.ndarray):
        self.bits = np.packbits(mask, bitorder="little")
        self.faiss = faiss.IDSelectorBitmap(len(mask), faiss.swig_ptr(self.bits))


def _build(x: np.ndarray, cfg: IndexConfig, kind: str):
    """(the searched index, the exact one): HNSW's flat storage is its exact index, no second copy."""
    n, d = x.shape
    if kind == "exact":
        flat = faiss.IndexFlatIP(d)
        flat.add(x)
        return flat, flat
    if kind == "hnsw":
        ann = faiss.IndexHNSWFlat(d, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        ann.hnsw.efConstruction = cfg.ef_construction
        ann.add(x)
        return ann, faiss.downcast_index(ann.storage)
    lists = cfg.ivf_lists or max(1, min(n // 39, int(4 * math.sqrt(n))))  # >= 39 points per cell to train
    quantizer = faiss.IndexFlatIP(d)
    ann = faiss.IndexIVFFlat(quantizer, d, lists, faiss.METRIC_INNER_PRODUCT)
    sample = x if n <= 256 * lists else x[np.random.default_rng(0).choice(n, 256 * lists, replace=False)]
    ann.train(sample)
    ann.add(x)
    flat = faiss.IndexFlatIP(d)
    flat.add(x)
    return ann, flat


def build_index(
    vecs: AdVectors, cfg: IndexConfig | None = None, eligibility: AdEligibility | None = None
) -> AdIndex:
    cfg = cfg or IndexConfig()
    cfg.validate()
    start = time.perf_counter()
    x = np.ascontiguousarray(vecs.vectors, np.float32)
    kind = cfg.resolved_kind(len(x))
    ann, flat = _build(x, cfg, kind)
    return AdIndex(
        ann, flat, vecs.ad_ids, vecs.model_version, kind, cfg, eligibility, time.perf_counter() - start
    )
