"""Cached per-ad query rows give the scores of the per-request computation (``serving.candidate_cache``)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from models.training.dense import DenseSpec
from serving import inputs as build
from serving.ad_table import AdSnapshot
from serving.candidate_cache import CandidateCache
from serving.scorer import score_shared
from tests.serving.test_scorer import _ranker, _user

ADS = 200  # ids 0..199 in the table (ids 0..49 inside the ranker's ad vocabulary, the rest on its OOV row)


def _arrays(seed: int) -> build.AdArrays:
    rng = np.random.default_rng(seed)
    ids = np.sort(np.append(rng.choice(ADS - 1, 149, replace=False), ADS - 1))  # 50 in range, unknown
    values = {"ad_advertiser_id": rng.integers(0, 6, 150), "ad_category_id": rng.integers(0, 5, 150),
              "a": rng.normal(size=150), "b": rng.normal(size=150), "c": rng.normal(size=150)}  # fmt: skip
    spec = DenseSpec.fit(pd.DataFrame(rng.normal(size=(20, 3)), columns=["a", "b", "c"]), ["a", "b", "c"])
    return build.AdArrays.build(AdSnapshot.from_rows(ids, values, None), spec)


def _scores(ranker, ads, ad_ids, surface, cache=None):
    cands, _ = build.candidates(ad_ids, surface, ads)
    queries = None if cache is None else cache.queries(ads, surface, ad_ids)
    return score_shared(ranker, _user(12, True), cands, 128, queries=queries), queries


def test_cached_rows_score_like_the_request_path():
    ranker, ads = _ranker(True), _arrays(0)
    cache = CandidateCache(ranker, max_bytes=2**20)
    ad_ids = np.random.default_rng(1).permutation(ADS)[:180]  # known, unknown-in-range and OOV-vocabulary ads
    for surface in (0, 3):
        cached, queries = _scores(ranker, ads, ad_ids, surface, cache)
        assert queries is not None and queries.first_query is not None
        plain, _ = _scores(ranker, ads, ad_ids, surface)
        np.testing.assert_allclose(cached, plain, atol=1e-5, rtol=0)
    assert set(cache._tables) == {0, 3}


def test_a_new_snapshot_replaces_the_rows():
    ranker, cache = _ranker(True), CandidateCache(_ranker(True), max_bytes=2**20)
    first, second = _arrays(0), _arrays(1)
    ad_ids = np.arange(100, dtype=np.int64)
    table = cache.table(first, 0)
    assert cache.table(first, 0) is table  # computed once per snapshot and surface
    cached, _ = _scores(ranker, second, ad_ids, 0, cache)
    assert cache.table(second, 0) is not table
    np.testing.assert_allclose(cached, _scores(ranker, second, ad_ids, 0)[0], atol=1e-5, rtol=0)


def test_what_the_cache_does_not_cover_takes_the_request_path():
    ranker, ads = _ranker(True), _arrays(0)
    cache = CandidateCache(ranker, max_bytes=2**20)
    assert cache.queries(ads, 0, np.array([5, ADS])) is None  # an id past the ad table
    assert cache.queries(ads, 0, np.array([], np.int64)) is None
    one_table = cache.table_bytes(ADS)
    assert one_table == ADS * 2 * 16 * 4  # token + first query, d_model 16, float32
    small = CandidateCache(ranker, max_bytes=one_table)  # room for one surface's table, not two
    assert small.queries(ads, 0, np.array([5])) is not None and small.held_bytes() == one_table
    assert small.queries(ads, 1, np.array([5])) is None  # would not fit: the request path computes it
    assert CandidateCache(ranker, max_bytes=0).queries(ads, 0, np.array([5])) is None  # off
    rows = cache.queries(ads, 0, np.array([7, 7, 3]))
    torch.testing.assert_close(rows.token[0], rows.token[1])


@pytest.mark.parametrize("pooling", ["target", "mean", "din"])
def test_cached_rows_score_without_the_candidates_features(pooling):
    """What serving runs where the cache covers a request: no ``Candidates`` built (``cands=None``), the same
    scores, in one batch and in several; and the unknown ads counted as ``build.candidates`` counts them."""
    ranker, ads = _ranker(True, pooling), _arrays(0)
    cache = CandidateCache(ranker, max_bytes=2**20)
    ad_ids = np.random.default_rng(1).permutation(ADS)[:180]
    cands, unknown = build.candidates(ad_ids, 3, ads)
    queries = cache.queries(ads, 3, ad_ids)
    assert unknown == ads.unknown_count(ad_ids) > 0
    for batch in (128, 512):
        with_features = score_shared(ranker, _user(12, True), cands, batch, queries=queries)
        without = score_shared(ranker, _user(12, True), None, batch, queries=queries)
        np.testing.assert_array_equal(without, with_features)
    with pytest.raises(ValueError, match="candidates or their queries"):
        score_shared(ranker, _user(12, True), None, 128)


def test_unknown_ads_are_counted_as_the_request_path_counts_them():
    ads = _arrays(0)
    assert (
        ads.unknown_count(np.array([-1, 0, ADS, 10**12]))
        == build.candidates(np.array([-1, 0, ADS, 10**12]), 0, ads)[1]
    )
