"""Retrieve -> rank in one request, over real HTTP (a ``gemflow serve`` with retrieval on, beside the shared one):
V1 and V2 answers name the stage and versions; filters hold; the caller-supplied path answers exactly as the
server without retrieval does; bad retrieval parameters are 4xx in each protocol's shape."""

from __future__ import annotations

import numpy as np
import pytest

from models.embeddings.ad_vectors import USER_QUERY_FILE, AdVectors, UserQueries, write_ad_vectors
from serving.client import post, v1_body, v2_body
from tests.serving.conftest import SERVER_SETTINGS
from tests.serving.world import (
    HEALTHY_USERS,
    MODEL,
    REQUEST_TS,
    USER_MODEL_VERSION,
    free_port,
    running_server,
)

CTX = {"request_ts": float(REQUEST_TS), "hour": 13}
MAX_K, DEFAULT_K, DIM = 40, 20, 8


@pytest.fixture(scope="module")
def vectors(world, tmp_path_factory):
    """Ad vectors for the world's ads and queries for its healthy users, of the version its embeddings carry."""
    rng = np.random.default_rng(11)
    folder = tmp_path_factory.mktemp("retrieval")
    ads = AdVectors(world.ads["ad_id"].to_numpy(np.int64), rng.standard_normal((len(world.ads), DIM)).astype(np.float32),
                    USER_MODEL_VERSION)  # fmt: skip
    users = np.array(HEALTHY_USERS, np.int64)
    queries = UserQueries(
        users, rng.standard_normal((len(users), DIM)).astype(np.float32), USER_MODEL_VERSION
    )
    write_ad_vectors(folder, ads)
    write_ad_vectors(folder, queries, name=USER_QUERY_FILE)
    return folder, ads, queries


@pytest.fixture(scope="module")
def retrieving(world, vectors, tmp_path_factory):
    settings = (*SERVER_SETTINGS, "retrieval.enabled=true", f"retrieval.folder={vectors[0]}",
                "retrieval.index.kind=hnsw", "retrieval.index.hnsw_m=8", f"retrieval.index.max_k={MAX_K}",
                f"retrieval.index.default_k={DEFAULT_K}")  # fmt: skip
    log = tmp_path_factory.mktemp("serve-retrieval") / "serve.log"
    with running_server(world, free_port(), log, *settings) as base:
        yield base


def _v1(base):
    return f"{base}/v1/models/{MODEL}:predict"


def _v2(base):
    return f"{base}/v2/models/{MODEL}/infer"


def exact_top(vectors, user: int, k: int, allowed=None) -> set[int]:
    _, ads, queries = vectors
    scores = ads.vectors @ queries.lookup(user)
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    return set(ads.ad_ids[np.argsort(-scores)[:k]].tolist())


def test_v1_retrieves_then_ranks_and_says_which_stage_did_what(retrieving, vectors):
    status, r = post(_v1(retrieving), v1_body(0, None, CTX, {"k": 15}))
    assert status == 200, r
    assert set(r["ad_ids"]) == exact_top(vectors, 0, 15)  # HNSW over 60 ads: the exact top 15
    assert r["p_click"] == sorted(r["p_click"], reverse=True)  # positions: the ranker's order
    assert sorted(r["retrieval_rank"]) == list(range(15))  # each ad's place before ranking
    ret = r["retrieval"]
    assert ret["stage"] == "retrieve -> rank" and ret["index_version"] == USER_MODEL_VERSION
    assert (ret["k"], ret["retrieved"], ret["eligible"], ret["short_of_k"]) == (15, 15, 60, None)
    assert ret["cold_start_query"] is False and ret["method"].startswith("hnsw")
    assert r["model_version"] == "ranker-run-1" and r["embedding_version"] == USER_MODEL_VERSION
    status, default = post(_v1(retrieving), v1_body(1, None, CTX))
    assert status == 200 and len(default["ad_ids"]) == DEFAULT_K == default["retrieval"]["k"]


def test_v2_retrieval_honours_advertiser_exclusions(retrieving, vectors, world):
    excluded = [0, 3]
    body = v2_body(3, None, {**CTX, "surface": "stories"}, {"k": 10, "exclude_advertisers": excluded})
    status, r = post(_v2(retrieving), body)
    assert status == 200, r
    out = {o["name"]: o["data"] for o in r["outputs"]}
    advertiser = dict(zip(world.ads["ad_id"], world.ads["ad_advertiser_id"], strict=True))
    allowed = ~np.isin(world.ads["ad_advertiser_id"].to_numpy(), excluded)
    assert set(out["ad_ids"]) == exact_top(vectors, 3, 10, allowed)
    assert not {advertiser[a] for a in out["ad_ids"]} & set(excluded)
    params = r["parameters"]
    assert params["retrieval.index_version"] == USER_MODEL_VERSION and params["retrieval.k"] == 10
    assert params["retrieval.eligible"] == int(allowed.sum())


def test_a_user_without_a_query_gets_the_cold_start_list(retrieving):
    status, r = post(_v1(retrieving), v1_body(4, None, CTX, {"k": 5}))
    assert status == 200, r
    assert r["retrieval"]["cold_start_query"] is True and len(r["ad_ids"]) == 5


def test_the_caller_supplied_path_answers_as_before(retrieving, server):
    body = v1_body(0, [5, 9, 1, 30], {**CTX, "surface": "stories"})
    with_retrieval, without = post(_v1(retrieving), body), post(_v1(server), body)
    assert with_retrieval[0] == without[0] == 200
    for key in ("ad_ids", "p_click", "p_conversion", "model_version", "embedding_version", "fallback"):
        assert with_retrieval[1][key] == without[1][key]
    assert "retrieval" not in with_retrieval[1] and "retrieval_rank" not in with_retrieval[1]


@pytest.mark.parametrize(
    "protocol, body, needle",
    [
        ("v1", v1_body(0, None, CTX, {"k": 0}), f"retrieve.k: 0 must be within 1..{MAX_K}"),
        ("v1", v1_body(0, None, CTX, {"k": MAX_K + 1}), f"retrieve.k: {MAX_K + 1} must be within 1..{MAX_K}"),
        ("v1", v1_body(0, None, CTX, {"k": 2.5}), "retrieve.k: Input should be a valid integer"),
        (
            "v1",
            v1_body(0, None, {**CTX, "surface": "billboard"}),
            "context.surface: 'billboard' is not one of",
        ),
        ("v1", {**v1_body(0, [1], CTX), "retrieve": {}}, "send either candidates or retrieve, not both"),
        ("v1", v1_body(0, None, CTX, {"exclude_advertisers": [-1]}), "retrieve.exclude_advertisers[0]"),
        ("v2", v2_body(0, None, CTX, {"k": 0}), f"retrieve.k: 0 must be within 1..{MAX_K}"),
        ("v2", v2_body(0, None, CTX, {"k": 10**6}), f"must be within 1..{MAX_K}"),
    ],
    ids=["k0", "k_over", "k_float", "surface", "both", "advertiser", "v2_k0", "v2_k_over"],
)
def test_bad_retrieval_parameters_are_4xx_in_the_protocols_shape(retrieving, protocol, body, needle):
    status, r = post(_v1(retrieving) if protocol == "v1" else _v2(retrieving), body)
    assert status == 400 and set(r) == {"error"}, r
    assert needle in r["error"]


def test_a_server_without_retrieval_refuses_a_request_without_candidates(server):
    status, r = post(_v1(server), v1_body(0, None, CTX, {"k": 5}))
    assert status == 400 and "does not retrieve candidates" in r["error"]


def test_gemflow_rank_without_candidates_retrieves_then_ranks(retrieving):
    from typer.testing import CliRunner

    from gemflow.cli import app

    result = CliRunner().invoke(
        app, ["rank", "--user", "0", "--top", "3", "--retrieve-k", "12", "--url", retrieving]
    )
    assert result.exit_code == 0, result.output
    assert len([line for line in result.output.splitlines() if line.startswith("ad ")]) == 3
    assert '"stage": "retrieve -> rank"' in result.output and '"retrieved": 12' in result.output
    bad = CliRunner().invoke(app, ["rank", "--user", "0", "--retrieve-k", "0", "--url", retrieving])
    assert bad.exit_code == 1 and "HTTP 400" in bad.output and "retrieve.k: 0 must be within" in bad.output
