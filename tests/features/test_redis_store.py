"""The same feature repo on a real Redis online store (a private redis-server per test module)."""

from __future__ import annotations

import datetime as dt
import shutil
import socket
import subprocess
import time

import pandas as pd
import pytest

from features.feature_repo import FeatureStoreConfig
from features.ingest import IngestConfig
from features.store import open_store
from tests.features.helpers import (
    DAY0,
    ads_frame,
    assert_online_values,
    events_frame,
    publish_without_gate,
    users_frame,
)

pytestmark = pytest.mark.integration

DAYS = (DAY0, DAY0 + dt.timedelta(days=1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (make redis installs it)")
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_apply_materialize_push_and_online_reads_on_redis(workspace, redis_url):
    cfg = IngestConfig(feature_store=FeatureStoreConfig(online_store="redis", redis_connection=redis_url))
    frames = {d: {"users": users_frame(d), "ads": ads_frame(d), "events": events_frame(d)} for d in DAYS}
    publish_without_gate(workspace, frames, cfg)
    store = open_store(workspace, cfg.feature_store)
    assert store.config.online_store.type == "redis"
    assert_online_values(store, frames)

    # A fresh event pushed online replaces the batch value (the streaming path).
    before = store.get_online_features(
        features=["user_recent_events:recent_ad_ids"], entity_rows=[{"user_id": 2}]
    )
    ads_seen = [*before.to_dict()["recent_ad_ids"][0], 13]
    now = pd.Timestamp(DAYS[1] + dt.timedelta(days=1), tz="UTC") + pd.Timedelta(minutes=5)
    row = pd.DataFrame(
        {
            "user_id": [2],
            "recent_ad_ids": [ads_seen],
            "recent_actions": [[0] * len(ads_seen)],
            "recent_category_ids": [[1] * len(ads_seen)],
            "recent_ts": [[int(now.timestamp())] * len(ads_seen)],
            "recent_time_gaps": [[0.0] * len(ads_seen)],
            "recent_surfaces": [[2] * len(ads_seen)],
            "recent_advertiser_ids": [[100] * len(ads_seen)],
            "recent_event_ids": [list(range(900_000, 900_000 + len(ads_seen)))],
            "recent_ts_us": [[int(now.timestamp()) * 1_000_000] * len(ads_seen)],
            "event_timestamp": [now],
            "created_timestamp": [now],
        }
    )
    store.push("user_recent_events_push", row)
    after = store.get_online_features(
        features=["user_recent_events:recent_ad_ids", "user_recent_events:recent_surfaces"],
        entity_rows=[{"user_id": 2}],
    ).to_dict()
    assert after["recent_ad_ids"][0] == ads_seen
    assert after["recent_surfaces"][0] == [2] * len(ads_seen)
