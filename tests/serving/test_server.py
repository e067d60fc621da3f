"""A real ``gemflow serve`` process over HTTP, on a tiny Feast SQLite store and a tiny ranker bundle."""

from __future__ import annotations

import json
import sqlite3
import time
import urllib.request

import numpy as np
import pytest

from serving.client import get, post, v1_body, v2_body
from tests.serving.world import (
    MODEL,
    REQUEST_TS,
    USER_MODEL_VERSION,
    build_world,
    free_port,
    running_server,
    write_offline_set,
)

pytestmark = pytest.mark.integration
MAX_CANDIDATES = 50


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("serving"))


@pytest.fixture(scope="module")
def server(world, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    settings = (
        f"limits.max_candidates={MAX_CANDIDATES}", "limits.max_body_bytes=4096", "limits.feature_timeout_ms=1500",
        "limits.request_timeout_ms=10000", "ad_table.refresh_seconds=3600",
    )  # fmt: skip
    try:
        with running_server(world, free_port(), log, *settings) as base:
            yield base
    except RuntimeError as err:
        pytest.fail(str(err))


def _v1(base):
    return f"{base}/v1/models/{MODEL}:predict"


def _v2(base):
    return f"{base}/v2/models/{MODEL}/infer"


def _raw(url: str, data: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


CTX = {"request_ts": float(REQUEST_TS)}
OK = {"user_id": 0, "candidates": [1, 2, 3]}

# (name, protocol, body: dict or raw bytes, substring the error must contain)
MALFORMED = [
    ("bad_json", "v1", b'{"user_id": 1,', "Unrecognized request format"),
    ("empty_body", "v1", b"", "Unrecognized request format"),
    ("body_is_list", "v1", [1, 2], "must be a JSON object"),
    ("body_is_string", "v1", "hello", "must be a JSON object"),
    ("missing_user_id", "v1", {"candidates": [1]}, "user_id: Field required"),
    ("user_id_string", "v1", {"user_id": "1", "candidates": [1]}, "user_id: Input should be a valid integer"),
    ("user_id_float", "v1", {"user_id": 1.5, "candidates": [1]}, "user_id: Input should be a valid integer"),
    ("user_id_bool", "v1", {"user_id": True, "candidates": [1]}, "user_id: Input should be a valid integer"),
    ("user_id_negative", "v1", {"user_id": -4, "candidates": [1]}, "user_id: Input should be greater than or equal to 0"),
    ("user_id_huge", "v1", {"user_id": 2**64, "candidates": [1]}, "user_id"),
    ("missing_candidates", "v1", {"user_id": 1}, "candidates: Field required"),
    ("candidates_not_list", "v1", {"user_id": 1, "candidates": "1,2"}, "candidates: Input should be a valid list"),
    ("candidates_empty", "v1", {"user_id": 1, "candidates": []}, "the list is empty"),
    ("candidates_too_many", "v1", {"user_id": 1, "candidates": list(range(MAX_CANDIDATES + 1))}, "more than the limit"),
    ("candidate_string", "v1", {"user_id": 1, "candidates": [1, "2"]}, "candidates[1]: Input should be a valid integer"),
    ("candidate_float", "v1", {"user_id": 1, "candidates": [1.5]}, "candidates[0]: Input should be a valid integer"),
    ("candidate_null", "v1", {"user_id": 1, "candidates": [None]}, "candidates[0]"),
    ("candidate_negative", "v1", {"user_id": 1, "candidates": [3, -1]}, "candidates[1]: Input should be greater than"),
    ("candidate_duplicate", "v1", {"user_id": 1, "candidates": [3, 4, 3]}, "duplicate ad id(s) [3]"),
    ("unknown_field", "v1", {**OK, "bid": 3}, "bid: Extra inputs are not permitted"),
    ("unknown_context_field", "v1", {**OK, "context": {"device": "ios"}}, "context.device: Extra inputs"),
    ("context_not_object", "v1", {**OK, "context": "feed"}, "context: Input should be a valid dictionary"),
    ("context_bad_surface", "v1", {**OK, "context": {"surface": "tv"}}, "'tv' is not one of"),
    ("context_hour_out_of_range", "v1", {**OK, "context": {"hour": 24}}, "context.hour"),
    ("context_nan_literal", "v1", b'{"user_id": 1, "candidates": [1], "context": {"request_ts": NaN}}', "Unrecognized"),
    ("context_nan_string", "v1", {**OK, "context": {"request_ts": "NaN"}}, "context.request_ts"),
    ("context_infinity", "v1", b'{"user_id": 1, "candidates": [1], "context": {"request_ts": 1e999}}', "infinity"),
    ("instances_two", "v1", {"instances": [OK, OK]}, "exactly one"),
    ("instances_with_extra", "v1", {"instances": [OK], "x": 1}, "no other top-level field"),
    ("body_too_large", "v1", {"user_id": 1, "candidates": [1] * 3000}, "exceeds the limit of 4096 bytes"),
    ("not_json_content_type", "v1-text", b"user=1", "must be JSON"),
    ("v2_bad_json", "v2", b'{"inputs": [', "detail"),
    ("v2_unknown_input", "v2", {"inputs": [{"name": "uid", "shape": [1], "datatype": "INT64", "data": [1]}]}, "'uid' is not known"),
    ("v2_candidates_fp32", "v2", {"inputs": [{"name": "user_id", "shape": [1], "datatype": "INT64", "data": [1]},
                                             {"name": "candidates", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, "datatype FP32"),
    ("v2_shape_mismatch", "v2", {"inputs": [{"name": "user_id", "shape": [1], "datatype": "INT64", "data": [1]},
                                            {"name": "candidates", "shape": [4], "datatype": "INT64", "data": [1, 2]}]}, "does not match"),
    ("v2_missing_user", "v2", {"inputs": [{"name": "candidates", "shape": [1], "datatype": "INT64", "data": [1]}]}, "user_id: Field required"),
    ("v2_negative_candidate", "v2", v2_body(1, [4, -9]), "candidates[1]"),
    ("v2_duplicate_candidate", "v2", v2_body(1, [4, 4]), "duplicate"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "protocol", "body", "needle"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_requests_get_a_4xx_naming_the_problem(server, name, protocol, body, needle):
    url = _v2(server) if protocol == "v2" else _v1(server)
    if protocol == "v1-text":
        status, reply = _raw(url, body, "text/plain")
    elif isinstance(body, bytes):
        status, reply = _raw(url, body)
    else:
        status, reply = post(url, body)
    assert 400 <= status < 500, (status, reply)
    assert needle in json.dumps(reply), reply


def test_v1_round_trip(server):
    status, r = post(_v1(server), v1_body(0, [5, 9, 1, 30], {**CTX, "surface": "stories"}))
    assert status == 200, r
    assert sorted(r["ad_ids"]) == [1, 5, 9, 30]
    assert r["p_click"] == sorted(r["p_click"], reverse=True)
    assert all(0 < p < 1 for p in r["p_click"] + r["p_conversion"])
    assert r["model_version"] == "ranker-run-1" and r["embedding_version"] == USER_MODEL_VERSION
    assert r["ad_table_as_of"] == "2026-03-03T00:00:00+00:00"
    assert r["fallback"]["degraded"] is False and r["fallback"]["cold_start"] is False
    status, wrapped = post(
        _v1(server), {"instances": [v1_body(0, [5, 9, 1, 30], {**CTX, "surface": "stories"})]}
    )
    assert status == 200 and wrapped["predictions"][0]["p_click"] == r["p_click"]


def test_v2_round_trip_matches_v1(server):
    status, r2 = post(_v2(server), v2_body(1, [7, 3, 12], CTX))
    assert status == 200, r2
    out = {o["name"]: o for o in r2["outputs"]}
    assert out["ad_ids"]["datatype"] == "INT64" and out["p_click"]["shape"] == [3]
    _, r1 = post(_v1(server), v1_body(1, [7, 3, 12], CTX))
    assert out["ad_ids"]["data"] == r1["ad_ids"]
    np.testing.assert_allclose(out["p_click"]["data"], r1["p_click"], rtol=1e-6)
    assert r2["parameters"]["embedding_version"] == USER_MODEL_VERSION
    assert r2["parameters"]["fallback.degraded"] is False


def test_unknown_user_and_missing_embedding_take_the_cold_start_path(server):
    _, unknown = post(_v1(server), v1_body(5, [1, 2, 3], CTX))
    assert unknown["fallback"]["cold_start"] and unknown["fallback"]["reasons"] == ["unknown_user"]
    assert unknown["embedding_version"] is None
    _, no_emb = post(_v1(server), v1_body(4, [1, 2, 3], CTX))
    assert no_emb["fallback"]["cold_start"] and no_emb["fallback"]["reasons"] == ["no_embedding"]


def test_embedding_version_mismatch_is_flagged_and_counted(server):
    before = get(f"{server}/v2/models/{MODEL}/stats")[1]["stats"]["embedding_version_mismatches"]
    _, r = post(_v1(server), v1_body(2, [1, 2, 3], CTX))
    assert r["fallback"]["embedding_version_mismatch"] and r["fallback"]["cold_start"]
    assert r["embedding_version"] != r["expected_user_model_version"] == USER_MODEL_VERSION
    after = get(f"{server}/v2/models/{MODEL}/stats")[1]["stats"]["embedding_version_mismatches"]
    assert after == before + 1
    with urllib.request.urlopen(f"{server}/metrics", timeout=5) as resp:
        assert "gemflow_ranker_embedding_version_mismatch_total" in resp.read().decode()


@pytest.mark.parametrize("user", [0, 1, 2, 4, 5])
def test_served_scores_equal_offline_batch_scores(server, world, tmp_path, user):
    """Train/serve consistency: the same model on the same features, online (HTTP) vs offline (training path)."""
    from models.data import BatchBuilder, TrainingSet
    from models.inference import load_bundle, predict

    cands = np.array([0, 4, 8, 15, 16, 23, 42, 59])
    _, served = post(_v1(server), v1_body(user, cands.tolist(), {**CTX, "surface": "reels"}))
    data = TrainingSet(
        write_offline_set(world, tmp_path / "set", user, cands, surface=2), require_ranker=True
    )
    bundle = load_bundle(world.model_path)
    emb, present, versions = data.user_embeddings()
    use = present & np.isin(
        data.ranker["model_version"].to_numpy(), [USER_MODEL_VERSION]
    )  # serving's version rule
    builder = BatchBuilder(
        data, bundle.dense, history_len=bundle.cfg.recent_events, time_buckets=bundle.cfg.time_buckets,
        gap_to="request", user_embeddings=emb if emb is not None else np.zeros((len(cands), 16), np.float32),
        user_present=use, num_user_tokens=bundle.cfg.num_user_tokens,
    )  # fmt: skip
    offline = predict(bundle.model, builder, np.arange(len(cands)), batch_size=3)
    order = np.argsort(-offline[:, 0], kind="stable")
    assert served["ad_ids"] == cands[order].tolist()
    np.testing.assert_allclose(served["p_click"], offline[order, 0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(served["p_conversion"], offline[order, 1], atol=1e-5, rtol=0)


def test_locked_feature_store_degrades_without_failing(server, world):
    db = world.ws.feature_repo / "online_store.db"
    lock = sqlite3.connect(db, timeout=1)
    lock.execute("BEGIN EXCLUSIVE")  # every reader now blocks on the file lock
    try:
        answers = []
        for _ in range(4):
            t0 = time.monotonic()
            status, r = post(_v1(server), v1_body(0, [1, 2, 3], CTX), timeout=15)
            answers.append((status, r, time.monotonic() - t0))
        for status, r, took in answers:
            assert status == 200, r
            assert r["fallback"]["degraded"] and r["fallback"]["feature_store_unavailable"]
            assert r["fallback"]["reasons"][0].startswith(("feature_store_timeout", "feature_store_busy")), r
            assert took < 5.0
        assert get(f"{server}/v2/models/{MODEL}/ready")[0] == 503  # readiness tells the truth meanwhile
    finally:
        lock.rollback()
        lock.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the stuck reads finish once the lock is gone; then all is healthy
        status, r = post(_v1(server), v1_body(0, [1, 2, 3], CTX))
        if status == 200 and not r["fallback"]["degraded"]:
            break
        time.sleep(0.5)
    assert not r["fallback"]["degraded"], r
    assert get(f"{server}/v2/models/{MODEL}/ready")[0] == 200


def test_stats_report_the_process_pauses(server):
    post(_v1(server), v1_body(0, [1, 2, 3], CTX))  # the first request starts the loop-lag probe
    time.sleep(0.1)
    status, body = get(f"{server}/v2/models/{MODEL}/stats")
    pauses = body["pauses"]
    assert status == 200 and pauses["frozen_objects"] > 10_000  # frozen after loading (serving.pauses)
    assert pauses["event_loop_lag"]["samples"] > 0 and pauses["event_loop_lag"]["p50_ms"] >= 0
    assert body["ad_table"]["loaded"] and body["ad_table"]["failures"] == 0


def test_readiness_reports_model_and_feature_store(server):
    status, ready = get(f"{server}/v2/models/{MODEL}/ready")
    assert (
        status == 200 and ready["ready"] and ready["feature_store"]["ok"] and ready["ad_table"]["ads"] == 60
    )
    assert get(f"{server}/v1/models/{MODEL}")[0] == 200
