"""Feature store stopped: a real ``gemflow serve`` on a real Redis online store, and Redis killed mid-test.

While Redis is down every request is still answered 200 on the degraded path (flagged, no user side: the
fallback the predictor takes when the store is unavailable), nothing is a 5xx, and the probes behave as the chart
expects: liveness and readiness stay 200 (this replica can answer; an outage of the shared store must not
unroute or restart every replica), while the readiness detail and ``/metrics`` report the store down.
Redis then restarts from its snapshot and the same server answers healthy again, without a restart of its own.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from features.feature_repo import FeatureStoreConfig
from serving.client import get, post, v1_body
from tests.serving.world import MODEL, REQUEST_TS, build_world, free_port, running_server

pytestmark = pytest.mark.integration
CTX = {"request_ts": float(REQUEST_TS)}


class RedisServer:
    """A private redis-server that can be killed and restarted on the same port, reloading its RDB snapshot."""

    def __init__(self, workdir: Path, port: int):
        self.workdir, self.port = workdir, port
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
               "--dbfilename", "dump.rdb", "--save", "", "--appendonly", "no"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait(up=True)

    def snapshot(self) -> None:
        import redis

        redis.Redis(port=self.port).save()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # no shutdown save: the process is simply gone
        self.proc.wait(timeout=10)
        self._wait(up=False)

    def _wait(self, up: bool) -> None:
        import redis

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                alive = True
            except redis.ConnectionError:
                alive = False
            if alive == up:
                return
            time.sleep(0.1)
        raise RuntimeError(f"redis on port {self.port} did not come {'up' if up else 'down'}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make redis installs it)")
    server = RedisServer(tmp_path_factory.mktemp("redis"), free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def served(redis_server, tmp_path_factory):
    store = FeatureStoreConfig(online_store="redis", redis_connection=f"127.0.0.1:{redis_server.port}")
    world = build_world(tmp_path_factory.mktemp("redis-world"), store_cfg=store)
    redis_server.snapshot()  # what the restarted Redis will reload
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    settings = (
        "feature_store.online_store=redis", f"feature_store.redis_connection={store.redis_connection}",
        "limits.feature_timeout_ms=1500", "limits.request_timeout_ms=10000", "ad_table.refresh_seconds=3600",
    )  # fmt: skip
    with running_server(world, free_port(), log, *settings) as base:
        yield base, log


def _rank(base: str, user: int) -> tuple[int, dict]:
    return post(f"{base}/v1/models/{MODEL}:predict", v1_body(user, [1, 2, 3, 4], CTX), timeout=15)


def test_redis_killed_degrades_without_failing_then_recovers(served, redis_server):
    base, log = served
    status, healthy = _rank(base, 0)
    assert status == 200 and not healthy["fallback"]["degraded"], healthy  # Redis serves the user side
    assert get(f"{base}/v2/models/{MODEL}/ready")[0] == 200

    redis_server.kill()
    for user in (0, 1, 5, 0):
        t0 = time.monotonic()
        status, r = _rank(base, user)
        assert status == 200, (status, r, log.read_text()[-2000:])
        fb = r["fallback"]
        assert fb["degraded"] and fb["feature_store_unavailable"], r
        # the kind only: the store's exception text (it names hosts and ports) stays in the server's log
        assert fb["reasons"][0] in ("feature_store_error", "feature_store_timeout"), r
        assert r["embedding_version"] is None and sorted(r["ad_ids"]) == [1, 2, 3, 4]
        assert all(0 < p < 1 for p in r["p_click"])
        assert time.monotonic() - t0 < 5.0
    time.sleep(1.1)  # readiness reuses a store probe for 1 s
    status, ready = get(f"{base}/v2/models/{MODEL}/ready")
    assert status == 200 and ready["feature_store"]["ok"] is False, ready
    assert ready["feature_store"]["problem"] in (
        "feature_store_error",
        "feature_store_timeout",
        "feature_store_busy",
    )
    assert ready["model_loaded"] and ready["ad_table"]["loaded"]  # the ad table keeps its last snapshot
    assert get(f"{base}/v2/health/live")[0] == 200
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert "gemflow_ranker_feature_store_up 0.0" in metrics
    assert "gemflow_ranker_degraded_fraction" in metrics

    redis_server.start()  # reloads dump.rdb
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        status, r = _rank(base, 0)
        if status == 200 and not r["fallback"]["degraded"]:
            break
        time.sleep(0.5)
    assert status == 200 and not r["fallback"]["degraded"], r
    assert r["embedding_version"] == healthy["embedding_version"]
    assert r["p_click"] == pytest.approx(healthy["p_click"], abs=1e-6)  # same user side as before the outage
    time.sleep(1.1)
    status, ready = get(f"{base}/v2/models/{MODEL}/ready")
    assert status == 200 and ready["feature_store"]["ok"] is True, ready
    stats = get(f"{base}/v2/models/{MODEL}/stats")[1]["stats"]
    assert (
        stats["fallbacks"].get("feature_store_error", 0) + stats["fallbacks"].get("feature_store_timeout", 0)
        >= 4
    )
