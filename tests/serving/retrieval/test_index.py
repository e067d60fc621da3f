"""The retrieval index on a small clustered catalog: ANN answers equal the exact ones, numpy's brute force is
the reference for exact, filters are honoured inside the search, K adjusts, a version mismatch is refused."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import REGISTRY

from features.schema import SURFACES
from models.embeddings.ad_vectors import AdVectors
from serving.retrieval.eligibility import AdEligibility, AdFilter, FilterError
from serving.retrieval.index import (
    IndexConfig,
    IndexVersionMismatch,
    RetrievalParamError,
    build_index,
)
from serving.schema import RequestError

VERSION = "gem-user-model/3"
N, D = 3000, 16


def clustered(n: int, d: int, seed: int) -> np.ndarray:
    """Unit vectors around 30 centres: the shape learned item spaces have (not uniform noise)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((30, d))
    x = centres[rng.integers(0, 30, n)] + 0.4 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def catalog() -> AdVectors:
    ids = np.sort(np.random.default_rng(1).choice(10**9, N, replace=False)).astype(np.int64)
    return AdVectors(ids, clustered(N, D, 0), VERSION)


@pytest.fixture(scope="module")
def eligibility() -> AdEligibility:
    rng = np.random.default_rng(2)
    return AdEligibility(
        paused=rng.random(N) < 0.1,
        surfaces=rng.integers(0, 1 << len(SURFACES), N),
        advertiser=rng.integers(0, 40, N),
    )


def brute_force(vecs: AdVectors, q: np.ndarray, k: int, allowed: np.ndarray | None = None) -> np.ndarray:
    scores = vecs.vectors @ q
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    order = np.argsort(-scores, kind="stable")[:k]
    return vecs.ad_ids[order[np.isfinite(scores[order])]]


QUERIES = clustered(20, D, 7) * 20.0  # the model's queries are cosine / temperature: norm 1 / 0.05


@pytest.mark.parametrize(
    "cfg",
    [
        IndexConfig(kind="exact"),
        IndexConfig(kind="hnsw", hnsw_m=16, ef_search=N),  # a beam as wide as the catalog: every ad is seen
        IndexConfig(kind="ivf", ivf_lists=16, nprobe=16),  # every cell probed
    ],
    ids=lambda c: c.kind,
)
def test_search_equals_exact_search_on_a_small_catalog(catalog, cfg):
    index = build_index(catalog, cfg)
    for q in QUERIES:
        hits = index.search(q, VERSION, 100)
        assert hits.ad_ids.tolist() == brute_force(catalog, q, 100).tolist()
        np.testing.assert_allclose(hits.scores, np.sort(catalog.vectors @ q)[::-1][:100], rtol=1e-5)
        assert hits.short_of_k is None and hits.model_version == VERSION


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_default_beams_recall_the_exact_top_k(catalog, kind):
    index = build_index(catalog, IndexConfig(kind=kind, hnsw_m=16, ef_search=200, ivf_lists=32, nprobe=8))
    recall = [
        len(set(index.search(q, VERSION, 100).ad_ids) & set(brute_force(catalog, q, 100))) / 100
        for q in QUERIES
    ]
    assert np.mean(recall) >= 0.95


@pytest.mark.parametrize("kind", ["exact", "hnsw", "ivf"])
def test_filters_are_honoured_inside_the_search_and_k_adjusts(catalog, eligibility, kind):
    index = build_index(catalog, IndexConfig(kind=kind, hnsw_m=16, ef_search=64, ivf_lists=32, nprobe=8),
                        eligibility)  # fmt: skip
    flt = AdFilter(surface="reels", exclude_advertisers=tuple(range(0, 40, 3)))
    allowed = eligibility.mask(flt)
    assert 0.2 < allowed.mean() < 0.5  # a filter that removes most of the catalog
    filtered, unfiltered = [], []
    for q in QUERIES[:5]:
        hits = index.search(q, VERSION, 200, flt)
        rows = np.searchsorted(catalog.ad_ids, hits.ad_ids)
        assert allowed[rows].all()  # paused ads, other surfaces and excluded advertisers never come back
        assert len(hits.ad_ids) == 200 and hits.eligible == int(allowed.sum())  # K eligible ads, not fewer
        assert not (eligibility.paused[rows]).any()
        filtered.append(len(set(hits.ad_ids) & set(brute_force(catalog, q, 200, allowed))) / 200)
        unfiltered.append(
            len(set(index.search(q, VERSION, 200).ad_ids) & set(brute_force(catalog, q, 200))) / 200
        )
    # the filter costs no recall: the widened beam finds the eligible top 200 as well as the plain one finds the top
    assert np.mean(filtered) >= np.mean(unfiltered) - 0.02
    assert np.mean(filtered) == 1.0 if kind == "exact" else np.mean(filtered) >= 0.85


def test_a_filter_leaving_fewer_ads_than_k_says_why(catalog, eligibility):
    index = build_index(catalog, IndexConfig(kind="hnsw", hnsw_m=16, ef_search=64), eligibility)
    advertisers = tuple(int(a) for a in np.unique(eligibility.advertiser) if a != 5)
    flt = AdFilter(surface="feed", exclude_advertisers=advertisers)  # one advertiser's live feed ads are left
    allowed = eligibility.mask(flt)
    hits = index.search(QUERIES[0], VERSION, 500, flt)
    assert hits.eligible == int(allowed.sum()) < 500
    assert sorted(hits.ad_ids.tolist()) == sorted(catalog.ad_ids[allowed].tolist())  # every one of them
    assert hits.method == "exact"  # under exact_below: the eligible ads are searched exactly
    assert hits.short_of_k == f"only {hits.eligible} ads are eligible under this filter (asked for 500)"
    top = index.search(
        QUERIES[1], VERSION, 10, flt
    )  # fewer than K eligible no more: the exact top 10 of them
    assert (
        top.ad_ids.tolist() == brute_force(catalog, QUERIES[1], 10, allowed).tolist()
        and top.method == "exact"
    )


def test_a_query_of_another_user_model_version_is_refused_and_counted(catalog):
    index = build_index(catalog, IndexConfig(kind="exact"))
    before = REGISTRY.get_sample_value("gemflow_retrieval_version_mismatch_total") or 0.0
    with pytest.raises(IndexVersionMismatch, match="gem-user-model/4.*gem-user-model/3"):
        index.search(QUERIES[0], "gem-user-model/4", 10)
    assert REGISTRY.get_sample_value("gemflow_retrieval_version_mismatch_total") == before + 1


@pytest.mark.parametrize("k", [0, -1, 5001, 2.5, True])
def test_k_out_of_bounds_is_a_client_error(catalog, k):
    index = build_index(catalog, IndexConfig(kind="exact", max_k=5000))
    with pytest.raises(RetrievalParamError, match=r"retrieve_k: .* must be an integer within 1\.\.5000"):
        index.search(QUERIES[0], VERSION, k)
    assert issubclass(RetrievalParamError, RequestError)


def test_an_unknown_surface_is_a_client_error(catalog):
    index = build_index(catalog, IndexConfig(kind="exact"))
    with pytest.raises(FilterError, match="surface 'billboard' is not one of"):
        index.search(QUERIES[0], VERSION, 10, AdFilter(surface="billboard"))


def test_a_bad_index_config_is_named():
    with pytest.raises(ValueError, match="kind must be one of"):
        IndexConfig(kind="annoy").validate()
    with pytest.raises(ValueError, match="default_k 9 must be within 1..max_k"):
        IndexConfig(max_k=8, default_k=9).validate()


def test_auto_is_exact_for_a_small_catalog_and_ivf_for_a_large_one(catalog):
    assert build_index(catalog, IndexConfig()).kind == "exact"  # 3,000 ads: a flat scan is the cheapest
    large = build_index(catalog, IndexConfig(exact_under=1000, ivf_lists=16, nprobe=16))
    assert large.kind == "ivf" and large.search(QUERIES[0], VERSION, 10).method == "ivf"
