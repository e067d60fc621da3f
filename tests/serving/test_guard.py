"""Tokens, admission control and deadlines on a real ``gemflow serve`` started with a bearer token, the
model-repository extension enabled behind an admin token, one admission slot and a 1.5 s request deadline."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import sqlite3
import time
import urllib.parse
from collections import Counter

import pytest

from tests.serving.conftest import SERVER_SETTINGS
from tests.serving.world import MODEL, REQUEST_TS, free_port, running_server

pytestmark = pytest.mark.integration
TOKEN, ADMIN = "t0ken-for-tests", "adm1n-for-tests"
PREDICT = f"/v1/models/{MODEL}:predict"
BODY = json.dumps(
    {"user_id": 0, "candidates": [1, 2, 3], "context": {"request_ts": float(REQUEST_TS)}}
).encode()
DEADLINE_S = 1.5


@pytest.fixture(scope="module")
def guarded(world, tmp_path_factory):
    log = tmp_path_factory.mktemp("guard-log") / "serve.log"
    settings = (*SERVER_SETTINGS, "limits.max_in_flight=1", f"limits.request_timeout_ms={1e3 * DEADLINE_S:.0f}",
                "limits.feature_timeout_ms=5000", "admin.repository_api=true")  # fmt: skip
    env = {"GEMFLOW_SERVING_TOKEN": TOKEN, "GEMFLOW_SERVING_ADMIN_TOKEN": ADMIN}
    with running_server(world, free_port(), log, *settings, env=env) as base:
        yield base


def call(base: str, method: str, path: str, body: bytes | None = None, token: str | None = TOKEN):
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=15)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def stats(base: str) -> dict:
    return json.loads(call(base, "GET", f"/v2/models/{MODEL}/stats")[2])["stats"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("POST", PREDICT, BODY), ("POST", f"/v2/models/{MODEL}/infer", b"{}"), ("GET", f"/v2/models/{MODEL}", None),
     ("GET", f"/v2/models/{MODEL}/stats", None)],
)  # fmt: skip
def test_inference_routes_need_the_bearer_token(guarded, method, path, body):
    for token in (None, "wrong", ADMIN):
        status, headers, payload = call(guarded, method, path, body, token)
        assert status == 401 and headers.get("www-authenticate") == "Bearer", (token, status)
        assert set(json.loads(payload)) == {"error"}
    assert call(guarded, method, path, body)[0] in (200, 400)  # with the token: past the gate


def test_probes_and_metrics_stay_open(guarded):
    for path in ("/v2/health/live", f"/v2/models/{MODEL}/ready", f"/v1/models/{MODEL}", "/metrics"):
        assert call(guarded, "GET", path, token=None)[0] == 200, path


def test_beyond_the_in_flight_limit_requests_are_shed_at_once(guarded, world):
    before = stats(guarded)
    lock = sqlite3.connect(world.ws.feature_repo / "online_store.db", timeout=1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        lock.execute("BEGIN EXCLUSIVE")  # the admitted request's user-side read waits: the one slot is taken
        try:
            holder = pool.submit(call, guarded, "POST", PREDICT, BODY)
            time.sleep(0.3)
            t0 = time.monotonic()
            status, headers, payload = call(guarded, "POST", PREDICT, BODY)
            assert status == 503 and headers.get("retry-after") == "1" and time.monotonic() - t0 < 1.0, (
                payload
            )
        finally:
            lock.rollback()
            lock.close()
        assert holder.result()[0] == 200
    after = stats(guarded)
    assert after["shed"].get("in_flight_limit", 0) == before["shed"].get("in_flight_limit", 0) + 1
    answered = sum(after["requests"].get(k, 0) - before["requests"].get(k, 0) for k in ("ok", "degraded"))
    assert answered == 1  # only the admitted request was scored and counted


def test_a_client_trickling_its_body_holds_no_slot(guarded):
    url = urllib.parse.urlsplit(guarded)
    holder = socket.create_connection((url.hostname, url.port), timeout=10)
    head = (f"POST {PREDICT} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(BODY)}\r\n\r\n").encode()  # fmt: skip
    holder.sendall(
        head + BODY[:10]
    )  # waiting for the rest of its body: no slot taken yet (admission after it)
    time.sleep(0.3)
    assert call(guarded, "POST", PREDICT, BODY)[0] == 200  # the one slot is free
    holder.sendall(BODY[10:])
    reply = holder.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_an_overload_burst_is_answered_and_the_counts_add_up(guarded):
    """30 requests from 10 clients at once against one admission slot: each is answered 200 or 503 (never a
    transport error), the server counted exactly those statuses, and every 503 was a shed request."""
    before = stats(guarded)
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        codes = Counter(pool.map(lambda _: call(guarded, "POST", PREDICT, BODY)[0], range(30)))
    after = stats(guarded)
    assert set(codes) <= {200, 503} and sum(codes.values()) == 30 and codes[200] >= 1, codes
    counted = {code: after["responses"].get(f"v1_predict {code}", 0) - before["responses"].get(f"v1_predict {code}", 0)
               for code in (200, 503)}  # fmt: skip
    assert counted == {200: codes[200], 503: codes[503]}
    shed = after["shed"].get("in_flight_limit", 0) - before["shed"].get("in_flight_limit", 0)
    answered = sum(after["requests"].get(k, 0) - before["requests"].get(k, 0) for k in ("ok", "degraded"))
    assert shed == codes[503] and answered == codes[200]


def test_work_past_its_deadline_is_cancelled_and_not_counted(guarded, world):
    before = stats(guarded)
    lock = sqlite3.connect(world.ws.feature_repo / "online_store.db", timeout=1)
    lock.execute("BEGIN EXCLUSIVE")  # the user-side read now blocks past the request deadline
    try:
        t0 = time.monotonic()
        status, headers, payload = call(guarded, "POST", PREDICT, BODY)
        took = time.monotonic() - t0
    finally:
        lock.rollback()
        lock.close()
    assert status == 503 and "did not finish" in json.loads(payload)["error"] and headers.get("retry-after")
    assert DEADLINE_S - 0.1 < took < DEADLINE_S + 1.5
    after = stats(guarded)
    assert after["shed"].get("deadline", 0) == before["shed"].get("deadline", 0) + 1
    assert after["requests"] == before["requests"]  # not counted as ok or degraded
    assert after["responses"].get("v1_predict 503", 0) == before["responses"].get("v1_predict 503", 0) + 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the blocked read finishes once the lock is gone
        status, _, payload = call(guarded, "POST", PREDICT, BODY)
        if status == 200 and not json.loads(payload)["fallback"]["degraded"]:
            break
        time.sleep(0.5)
    assert status == 200


def test_a_body_that_never_arrives_is_answered_408(guarded):
    url = urllib.parse.urlsplit(guarded)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.sendall((f"POST {PREDICT} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\n{{").encode())  # fmt: skip
    t0 = time.monotonic()
    reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < DEADLINE_S + 1.5, reply[:200]


def test_model_repository_needs_the_admin_token(guarded):
    unload = f"/v2/repository/models/{MODEL}/unload"
    for token in (None, TOKEN):
        assert call(guarded, "POST", unload, b"{}", token)[0] == 401, token
    assert call(guarded, "POST", PREDICT, BODY)[0] == 200
    status, _, payload = call(guarded, "POST", unload, b"{}", ADMIN)  # the operator's call: allowed
    assert status == 200, payload
    assert call(guarded, "GET", f"/v2/models/{MODEL}/ready", token=None)[0] == 503  # unrouted, honestly
    status, _, payload = call(guarded, "POST", PREDICT, BODY)
    assert status == 503 and "not loaded" in json.loads(payload)["error"]
    assert call(guarded, "GET", "/v2/health/live", token=None)[0] == 200
