"""A real ``gemflow serve`` process over HTTP, on a tiny Feast SQLite store and a tiny ranker bundle."""

from __future__ import annotations

import http.client
import json
import sqlite3
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest

from serving.client import get, post, v1_body, v2_body
from tests.serving.conftest import MAX_BODY_BYTES, MAX_CANDIDATES
from tests.serving.world import MODEL, REQUEST_TS, USER_MODEL_VERSION, write_offline_set

pytestmark = pytest.mark.integration


def _v1(base):
    return f"{base}/v1/models/{MODEL}:predict"


def _v2(base):
    return f"{base}/v2/models/{MODEL}/infer"


def _raw(url: str, data: bytes, content_type: str | None = "application/json", **headers) -> tuple[int, dict]:
    """POST with exactly these headers (http.client adds no Content-Type of its own, unlike urllib)."""
    if content_type is not None:
        headers["Content-Type"] = content_type
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("POST", parts.path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


CTX = {"request_ts": float(REQUEST_TS)}
OK = {"user_id": 0, "candidates": [1, 2, 3]}

# (name, protocol, body: dict or raw bytes, substring the error must contain)
MALFORMED = [
    ("bad_json", "v1", b'{"user_id": 1,', "not valid JSON"),
    ("empty_body", "v1", b"", "not valid JSON"),
    ("body_is_list", "v1", [1, 2], "must be a JSON object"),
    ("body_is_string", "v1", "hello", "must be a JSON object"),
    ("missing_user_id", "v1", {"candidates": [1]}, "user_id: Field required"),
    # text ids are the caller's own ids (issue 34): accepted, but not empty
    ("user_id_empty_text", "v1", {"user_id": "", "candidates": [1]}, "user_id: String should have at least 1 character"),
    ("user_id_float", "v1", {"user_id": 1.5, "candidates": [1]}, "user_id: Input should be a valid integer"),
    ("user_id_bool", "v1", {"user_id": True, "candidates": [1]}, "user_id: Input should be a valid integer"),
    ("user_id_negative", "v1", {"user_id": -4, "candidates": [1]}, "user_id: Input should be greater than or equal to 0"),
    ("user_id_huge", "v1", {"user_id": 2**64, "candidates": [1]}, "user_id"),
    ("missing_candidates", "v1", {"user_id": 1}, "candidates: Field required"),
    ("candidates_not_list", "v1", {"user_id": 1, "candidates": "1,2"}, "candidates: Input should be a valid list"),
    ("candidates_empty", "v1", {"user_id": 1, "candidates": []}, "the list is empty"),
    ("candidates_too_many", "v1", {"user_id": 1, "candidates": list(range(MAX_CANDIDATES + 1))}, "more than the limit"),
    ("candidate_empty_text", "v1", {"user_id": 1, "candidates": [1, ""]}, "candidates[1]: String should have at least 1 character"),
    ("candidate_float", "v1", {"user_id": 1, "candidates": [1.5]}, "candidates[0]: Input should be a valid integer"),
    ("candidate_null", "v1", {"user_id": 1, "candidates": [None]}, "candidates[0]"),
    ("candidate_negative", "v1", {"user_id": 1, "candidates": [3, -1]}, "candidates[1]: Input should be greater than"),
    ("candidate_duplicate", "v1", {"user_id": 1, "candidates": [3, 4, 3]}, "duplicate ad id(s) [3]"),
    ("unknown_field", "v1", {**OK, "bid": 3}, "bid: Extra inputs are not permitted"),
    ("unknown_context_field", "v1", {**OK, "context": {"device": "ios"}}, "context.device: Extra inputs"),
    ("context_not_object", "v1", {**OK, "context": "feed"}, "context: Input should be a valid dictionary"),
    ("context_bad_surface", "v1", {**OK, "context": {"surface": "tv"}}, "'tv' is not one of"),
    ("context_hour_out_of_range", "v1", {**OK, "context": {"hour": 24}}, "context.hour"),
    ("context_nan_literal", "v1", b'{"user_id": 1, "candidates": [1], "context": {"request_ts": NaN}}', "not valid JSON"),
    ("context_nan_string", "v1", {**OK, "context": {"request_ts": "NaN"}}, "context.request_ts"),
    ("context_infinity", "v1", b'{"user_id": 1, "candidates": [1], "context": {"request_ts": 1e999}}', "infinity"),
    ("request_ts_1e19", "v1", {**OK, "context": {"request_ts": 1e19}}, "outside the accepted window"),
    ("request_ts_1e300", "v1", {**OK, "context": {"request_ts": 1e300}}, "outside the accepted window"),
    ("request_ts_int64_max", "v1", {**OK, "context": {"request_ts": 2**63 - 1}}, "outside the accepted window"),
    ("request_ts_1970", "v1", {**OK, "context": {"request_ts": 86400.0}}, "outside the accepted window"),
    ("instances_two", "v1", {"instances": [OK, OK]}, "exactly one"),
    ("instances_with_extra", "v1", {"instances": [OK], "x": 1}, "no other top-level field"),
    ("body_too_large", "v1", {"user_id": 1, "candidates": [1] * 3000}, f"exceeds the limit of {MAX_BODY_BYTES} bytes"),
    ("not_json_content_type", "v1-text", b"user=1", "must be JSON"),
    ("v2_bad_json", "v2", b'{"inputs": [', "not valid JSON"),
    ("v2_unknown_input", "v2", {"inputs": [{"name": "uid", "shape": [1], "datatype": "INT64", "data": [1]}]}, "'uid' is not known"),
    ("v2_candidates_fp32", "v2", {"inputs": [{"name": "user_id", "shape": [1], "datatype": "INT64", "data": [1]},
                                             {"name": "candidates", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, "datatype 'FP32'"),
    ("v2_shape_mismatch", "v2", {"inputs": [{"name": "user_id", "shape": [1], "datatype": "INT64", "data": [1]},
                                            {"name": "candidates", "shape": [4], "datatype": "INT64", "data": [1, 2]}]}, "data has 2"),
    ("v2_missing_user", "v2", {"inputs": [{"name": "candidates", "shape": [1], "datatype": "INT64", "data": [1]}]}, "user_id: Field required"),
    ("v2_negative_candidate", "v2", v2_body(1, [4, -9]), "candidates[1]"),
    ("v2_duplicate_candidate", "v2", v2_body(1, [4, 4]), "duplicate"),
    ("v2_request_ts_int64_max", "v2", {"inputs": [*v2_body(1, [4])["inputs"], {"name": "request_ts", "shape": [1], "datatype": "INT64", "data": [2**63 - 1]}]}, "outside the accepted window"),
    ("v2_request_ts_1e300", "v2", {"inputs": [*v2_body(1, [4])["inputs"], {"name": "request_ts", "shape": [1], "datatype": "FP64", "data": [1e300]}]}, "outside the accepted window"),
    ("v2_negative_shape", "v2", {"inputs": [v2_body(1, [4])["inputs"][0], {"name": "candidates", "shape": [-3, -1], "datatype": "INT64", "data": [3]}]}, "negative dimension"),
    ("v2_empty_shape", "v2", {"inputs": [v2_body(1, [4])["inputs"][0], {"name": "candidates", "shape": [], "datatype": "INT64", "data": [3]}]}, "shape must be a list of 1 or 2"),
    ("v2_uint8_300", "v2", {"inputs": [v2_body(1, [4])["inputs"][0], {"name": "candidates", "shape": [1], "datatype": "UINT8", "data": [300]}]}, "outside UINT8's range"),
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
    assert set(reply) == {"error"} and needle in reply["error"], reply


BINARY_HEAD = b'{"inputs": [{"name": "user_id", "shape": [1], "datatype": "INT64", "parameters": {"binary_data_size": 7}}]}'
# (name, protocol, body, extra headers, Content-Type or None, expected status, substring of the error)
BY_HEADERS = [
    ("v1_no_content_type", "v1", json.dumps(OK).encode(), {}, None, 415, "Content-Type: application/json"),
    ("v1_gzip", "v1", json.dumps(OK).encode(), {"Content-Encoding": "gzip"}, "application/json", 415, "uncompressed"),
    ("v2_gzip", "v2", json.dumps(v2_body(1, [4])).encode(), {"Content-Encoding": "gzip"}, None, 415, "uncompressed"),
    ("v2_text_plain", "v2", json.dumps(v2_body(1, [4])).encode(), {}, "text/plain", 415, "not accepted"),
    ("v2_binary_header_abc", "v2", b"{}", {"Inference-Header-Content-Length": "abc"}, None, 400, "Inference-Header-Content-Length"),
    ("v2_binary_header_too_long", "v2", b"{}", {"Inference-Header-Content-Length": "99"}, None, 400, "Inference-Header-Content-Length"),
    ("v2_binary_size_not_multiple", "v2", BINARY_HEAD + b"\x01" * 7, {"Inference-Header-Content-Length": str(len(BINARY_HEAD))}, None, 400, "is not 1 INT64"),
    ("v2_binary_size_past_end", "v2", BINARY_HEAD + b"\x01" * 3, {"Inference-Header-Content-Length": str(len(BINARY_HEAD))}, None, 400, "binary_data_size"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "protocol", "body", "headers", "ctype", "code", "needle"), BY_HEADERS,
                         ids=[c[0] for c in BY_HEADERS])  # fmt: skip
def test_headers_and_encodings_are_handled_or_refused(
    server, name, protocol, body, headers, ctype, code, needle
):
    url = _v2(server) if protocol == "v2" else _v1(server)
    status, reply = _raw(url, body, ctype, **headers)
    assert status == code and needle in reply["error"], (status, reply)


def test_unload_attack_is_refused_and_ranking_keeps_answering(server):
    for path in (
        f"/v2/repository/models/{MODEL}/unload",
        f"/v2/repository/models/{MODEL}/load",
        "/v2/repository/index",
    ):
        status, reply = _raw(server + path, b"{}")
        assert status == 404 and "disabled" in reply["error"], (path, status, reply)
    status, r = post(_v1(server), v1_body(0, [1, 2, 3], CTX))
    assert status == 200 and not r["fallback"]["degraded"]
    assert get(f"{server}/v2/models/{MODEL}/ready")[0] == 200


def test_client_mistakes_log_one_line_and_leak_nothing(server, server_log):
    # (a text user id is valid since issue 34: the mistake is an unknown surface carrying the marker)
    status, reply = post(
        _v1(server), {"user_id": 1, "candidates": [1], "context": {"surface": "x-marker-17"}}
    )
    assert status == 400 and "Traceback" not in json.dumps(reply)
    time.sleep(0.2)
    lines = [ln for ln in server_log.read_text().splitlines() if "x-marker-17" in ln]
    assert len(lines) == 1 and "400 POST" in lines[0], lines
    assert "Traceback" not in server_log.read_text()


def test_metadata_lists_the_tensors(server):
    status, meta = get(f"{server}/v2/models/{MODEL}")
    assert status == 200
    inputs = {t["name"]: t for t in meta["inputs"]}
    assert inputs["candidates"] == {**inputs["candidates"], "datatype": "INT64", "shape": [-1]}
    assert set(inputs) == {
        "user_id",
        "candidates",
        "surface",
        "hour",
        "request_ts",
        "retrieve_k",
        "exclude_advertisers",
    }
    assert inputs["retrieve_k"]["parameters"]["optional"] is True  # retrieval: only without candidates
    assert [(o["name"], o["datatype"]) for o in meta["outputs"]] == [
        ("ad_ids", "INT64"), ("p_click", "FP32"), ("p_conversion", "FP32")]  # fmt: skip


def test_every_response_is_counted_by_status(server):
    post(_v1(server), {"user_id": -1, "candidates": [1]})
    with urllib.request.urlopen(f"{server}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'gemflow_ranker_http_responses_total{code="400",route="v1_predict"}' in text
    assert 'gemflow_ranker_http_responses_total{code="200",route="ready"}' in text


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
    from models.inference.bundle import load_bundle, predict
    from models.training.batch_builder import BatchBuilder
    from models.training.data import TrainingSet

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
        user_present=use, num_user_tokens=bundle.cfg.num_user_tokens, fresh_delay_s=bundle.cfg.fresh_delay_s,
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
        time.sleep(1.1)  # the store's health probe result is reused for 1 s
        status, ready = get(f"{server}/v2/models/{MODEL}/ready")
        # this replica can still answer: ready; the store's state is reported, not routed on
        assert status == 200 and ready["feature_store"]["ok"] is False, ready
        with urllib.request.urlopen(f"{server}/metrics", timeout=5) as resp:
            assert "gemflow_ranker_feature_store_up 0.0" in resp.read().decode()
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


def test_docs_page_lists_the_servers_routes(server):
    """``/docs`` is the gateway's own page (KServe's Swagger UI loads its scripts from a CDN): no token needed."""
    with urllib.request.urlopen(f"{server}/docs", timeout=10) as r:
        page = r.read().decode()
        assert r.status == 200 and r.headers["content-type"].startswith("text/html")
    for route in (f"/v1/models/{MODEL}:predict", f"/v2/models/{MODEL}/infer", f"/v2/models/{MODEL}/ready"):
        assert route in page
    assert "<script" not in page
    assert "<code>/v2/health/ready</code></td><td>server readiness" in page  # not labelled "server live"


def test_docs_are_the_openapi_document_of_the_routes_the_server_answers(server):
    """``/docs`` renders ``/docs/openapi.json``; every operation it documents answers 200 on the real server (with
    a valid body where it takes one), and the page lists each."""
    status, doc = get(f"{server}/docs/openapi.json")
    assert status == 200 and doc["openapi"] == "3.1.0" and doc["info"]["title"] == f"{MODEL} ranker endpoint"
    with urllib.request.urlopen(f"{server}/docs", timeout=10) as r:
        page = r.read().decode()
    bodies = {"v1_predict": v1_body(0, [1, 2, 3], CTX), "v2_infer": v2_body(0, [1, 2, 3], CTX)}
    operations = [(m.upper(), p, op) for p, ops in doc["paths"].items() for m, op in ops.items()]
    documented = {op["operationId"] for *_, op in operations}
    assert documented >= {"v1_predict", "v2_infer", "ready", "stats", "live", "server_ready"}
    parts = urllib.parse.urlsplit(server)
    for method, path, op in operations:
        assert f"<td>{method}</td><td><code>{path}</code></td>" in page
        assert "200" in op["responses"] and op["summary"]
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        try:
            body = bodies.get(op["operationId"])
            conn.request(method, path, body=json.dumps(body) if body else None,
                         headers={"Content-Type": "application/json"} if body else {})  # fmt: skip
            resp = conn.getresponse()
            resp.read()
        finally:
            conn.close()
        assert resp.status == 200, (method, path, resp.status)
    schemas = doc["components"]["schemas"]
    # candidates or retrieve (the server finds them, issue 37): only the user is required by the schema itself
    assert set(schemas["RankRequest"]["required"]) == {"user_id"} and "RankContext" in schemas
    assert {"candidates", "retrieve"} <= set(schemas["RankRequest"]["properties"])


@pytest.mark.parametrize(
    ("method", "path", "code"),
    [("POST", f"/v1/models/{MODEL}:explain", 404), ("POST", "/docs", 404), ("GET", "/openapi.json", 404),
     ("POST", f"/v2/models/{MODEL}/versions/1/infer", 404), ("GET", f"/v2/models/{MODEL}/infer", 405),
     ("DELETE", f"/v1/models/{MODEL}:predict", 405), ("POST", "/v1/models/other:predict", 404),
     ("GET", "/v2/models/other/ready", 404), ("GET", "/v2", 200), ("GET", "/v2/models", 200)],
)  # fmt: skip
def test_only_the_servers_routes_answer(server, method, path, code):
    parts = urllib.parse.urlsplit(server)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path, body=b"{}" if method == "POST" else None)
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == code, (resp.status, body)
    assert code == 200 or set(body) == {"error"}, body


def test_unknown_ads_mark_the_answer_degraded(server):
    status, answer = post(_v1(server), v1_body(1, [1, 2, 10**6], {"request_ts": float(REQUEST_TS)}))
    fb = answer["fallback"]
    assert status == 200 and fb["unknown_ads"] == 1 and fb["degraded"] and "unknown_ads" in fb["reasons"], fb


def test_server_metadata_does_not_advertise_the_disabled_repository_extension(server):
    status, meta = get(f"{server}/v2")
    assert status == 200 and "model_repository_extension" not in meta.get("extensions", []), meta


def test_kserves_own_errors_answer_the_protocols_shape(server):
    parts = urllib.parse.urlsplit(server)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("POST", "/v2/health/live", body=b"{}")  # KServe's route, answered by FastAPI: 405
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 405 and set(body) == {"error"}, body


def test_a_newline_in_a_path_cannot_forge_a_log_line(server, server_log):
    forged = "INFO serving.gateway: forged"
    status, _ = _raw(f"{server}/v1/models/x%0a{urllib.parse.quote(forged)}:predict", b"{}")
    assert status == 404
    time.sleep(0.2)
    lines = server_log.read_text().splitlines()
    assert not any(line.startswith(forged) for line in lines)
    assert any("x\\n" + forged in line for line in lines)
