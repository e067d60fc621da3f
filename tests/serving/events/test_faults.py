"""Faults of the live event path, on real processes: the collector SIGKILLed mid-stream, and the online store
(a real Redis) killed and restarted under it."""

from __future__ import annotations

import itertools
import shutil
import threading
import time

import httpx
import numpy as np
import pandas as pd
import pytest

from features import recent_events
from features.ingest import ingest
from features.stats import read_events
from features.store import open_store
from gemflow.workspace import Workspace
from serving.events.log import EventLog
from tests.features.helpers import ADS, USERS, ts
from tests.ports import free_port
from tests.serving.events.collector import DAY1, N, ingest_config, prepare, running
from tests.serving.events.test_collector import exported_ids, wait_exported
from tests.serving.test_redis_outage import RedisServer

pytestmark = pytest.mark.integration


def make_events(ids) -> list[dict]:
    rng = np.random.default_rng(list(ids)[:1])
    out = []
    for i in ids:
        out.append({"event_id": int(i), "user_id": int(rng.choice(USERS)), "ad_id": int(rng.choice(list(ADS))),
                    "action": "view", "surface": "feed", "ts": ts(DAY1, 3600 + int(i) % 80_000).isoformat(),
                    "click": 0, "conversion": 0})  # fmt: skip
    return out


def logged(ws) -> pd.DataFrame:
    conn = EventLog(ws.root / "events" / "events.db").conn
    return pd.read_sql("SELECT * FROM events", conn)


def test_sigkill_mid_stream_loses_no_acknowledged_event(tmp_path):
    ws = Workspace(tmp_path / "ws")
    prepare(ws)
    acked: list[int] = []
    ids = itertools.count(1_000_000, 1)
    lock, stop = threading.Lock(), threading.Event()
    log = tmp_path / "collector.log"
    with running(ws, log) as c:

        def send():
            while not stop.is_set():
                with lock:
                    batch = make_events([next(ids) for _ in range(20)])
                try:
                    r = httpx.post(f"{c.url}/v1/events", json={"events": batch}, timeout=10)
                except httpx.HTTPError:
                    continue  # the collector is gone: not acknowledged
                if r.status_code == 200:
                    with lock:
                        acked.extend(e["event_id"] for e in batch)

        senders = [threading.Thread(target=send) for _ in range(4)]
        for s in senders:
            s.start()
        deadline = time.monotonic() + 30
        while len(acked) < 400 and time.monotonic() < deadline:
            time.sleep(0.05)
        c.kill()
        stop.set()
        for s in senders:
            s.join()
    assert len(acked) >= 400
    durable = logged(ws)
    assert set(acked) <= set(durable["event_id"])
    with running(ws, log) as c:  # restarted: merges what was not yet online, exports the rest
        wait_exported(ws, durable["event_id"].tolist())
        assert c.get("/health/ready").status_code == 200
    assert len(exported_ids(ws)) == len(set(exported_ids(ws)))  # no event exported twice
    summary = ingest(ws, DAY1, ingest_config())
    assert summary["tables"]["events"]["accepted"] == len(durable)
    assert summary["tables"]["events"]["quarantined"] == 0
    history = read_events(ws, [DAY1 - pd.Timedelta(days=1), DAY1]).sort_values(
        ["user_id", "ts_us", "event_id"]
    )
    store = open_store(ws, ingest_config().feature_store)
    online, _ = recent_events.read_online(store, USERS)
    for user in USERS:
        want = history[history["user_id"] == user]["event_id"].tolist()[-N:]
        assert online[online["user_id"] == user]["event_id"].tolist() == want


@pytest.fixture
def redis_server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make redis installs it)")
    server = RedisServer(tmp_path / "redis", free_port())
    (tmp_path / "redis").mkdir()
    server.start()
    yield server
    server.stop()


def test_online_store_restart_refuses_with_503_then_the_events_become_visible(tmp_path, redis_server):
    store_cfg = {"online_store": "redis", "redis_connection": f"127.0.0.1:{redis_server.port}"}
    ws = Workspace(tmp_path / "ws")
    prepare(ws, **store_cfg)
    redis_server.snapshot()
    settings = [f"feature_store.{k}={v}" for k, v in store_cfg.items()]
    first, second, third = make_events([5_000_001, 5_000_002, 5_000_003])
    store = open_store(ws, ingest_config(**store_cfg).feature_store)

    def online_ids(user):
        found, _ = recent_events.read_online(store, [user])
        return found["event_id"].tolist()

    with running(ws, tmp_path / "collector.log", *settings) as c:
        assert c.post(first).status_code == 200
        redis_server.snapshot()
        redis_server.kill()
        r = c.post(second)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "durable" in r.json()["error"]
        assert c.get("/health/ready").status_code == 503
        redis_server.start()  # reloads its snapshot: the list as of before the outage
        deadline = time.monotonic() + 20
        while second["event_id"] not in online_ids(second["user_id"]):  # no client retry needed
            assert time.monotonic() < deadline, "the refused event never became visible"
            time.sleep(0.2)
        assert c.get("/health/ready").status_code == 200
        again = c.post(second)  # the client's retry: counted once
        assert again.status_code == 200 and again.json() == {"accepted": 1, "duplicates": 1}
        assert c.post(third).status_code == 200
    assert online_ids(second["user_id"]).count(second["event_id"]) == 1
    assert sorted(logged(ws)["event_id"]) == [5_000_001, 5_000_002, 5_000_003]
