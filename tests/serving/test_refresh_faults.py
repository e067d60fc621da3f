"""The ad-table refresh child of a running server killed again and again, in the environment ``make demo`` gives it
(a launcher's Feast metrics folder, deleted once the server is up): it comes back every time, ``/metrics`` counts
its deaths and restarts, and an ad added to the store after the kills is served after the next refresh."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import shutil
import time
import urllib.request

import pandas as pd
import psutil
import pyarrow as pa
import pytest

from features.feature_repo.offline import write_partition
from features.feature_repo.tables import FEATURE_TABLES
from features.store import open_store
from gemflow.workspace import Workspace
from serving.client import get, post, v1_body
from tests.serving.conftest import SERVER_SETTINGS
from tests.serving.world import DAY, DAY_END, MODEL, REQUEST_TS, free_port, running_server

pytestmark = pytest.mark.integration
KILLS = 3


def _refresh_child(server_pid: int) -> psutil.Process | None:
    for child in psutil.Process(server_pid).children():
        try:
            if (
                child.is_running()
                and child.status() != psutil.STATUS_ZOMBIE
                and any(
                    "spawn_main" in part
                    for part in child.cmdline()  # (not the resource tracker)
                )
            ):
                return child
        except psutil.Error:  # one just killed, gone meanwhile
            continue
    return None


def _metric(base: str, name: str, child: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    found = re.search(rf'^{name}_total{{child="{child}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _wait(what: str, check, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def _add_ad(ws: Workspace, ad_id: int, template: pd.DataFrame) -> None:
    """A new ad in the offline tables (the ad universe) and the online store, as a materialization writes it."""
    row = template.iloc[[0]].copy()
    row["ad_id"] = ad_id
    row["event_timestamp"] = row["created_timestamp"] = pd.Timestamp(DAY_END)
    store = open_store(ws)
    for table in ("ad_attributes", "ad_stats"):
        schema = FEATURE_TABLES[table]
        write_partition(ws.offline(table, DAY + dt.timedelta(days=1)),
                        pa.Table.from_pandas(row[schema.names], schema=schema, preserve_index=False))  # fmt: skip
        store.write_to_online_store(table, row[schema.names])


def test_the_refresh_child_comes_back_after_each_kill_and_serves_new_ads(world, tmp_path):
    ws = Workspace(shutil.copytree(world.ws.root, tmp_path / "ws"))  # this test writes to its store
    launcher_metrics = tmp_path / "feast_metrics_launcher"
    launcher_metrics.mkdir()
    env = {
        "PROMETHEUS_MULTIPROC_DIR": str(launcher_metrics),
        "PROMETHEUS_MULTIPROCESS_DIR": str(launcher_metrics),
    }
    settings = [*SERVER_SETTINGS, "ad_table.refresh_seconds=1"]
    with running_server(dataclasses.replace(world, ws=ws), free_port(), tmp_path / "serve.log", *settings,
                        env=env) as base:  # fmt: skip
        shutil.rmtree(launcher_metrics)  # the launcher exited: its folder is gone, the variables stay
        pid = get(f"{base}/v2/models/{MODEL}/stats")[1]["pid"]
        child = _wait("the refresh child", lambda: _refresh_child(pid))
        for kill in range(KILLS):
            child.kill()
            child = _wait(f"a new refresh child after kill {kill + 1}",
                          lambda old=child.pid: (c := _refresh_child(pid)) and c.pid != old and c)  # fmt: skip
        deaths = _metric(base, "gemflow_ranker_child_deaths", "ad_refresh")
        restarts = _metric(base, "gemflow_ranker_child_restarts", "ad_refresh")
        print(
            f"after {KILLS} kills: child_deaths{{ad_refresh}}={deaths:.0f}, child_restarts{{ad_refresh}}={restarts:.0f}"
        )
        assert deaths >= KILLS and restarts >= KILLS

        new_ad = int(world.ads["ad_id"].max()) + 1
        _add_ad(ws, new_ad, world.ads)
        ready = _wait("the new ad in the ad table",
                      lambda: (r := get(f"{base}/v2/models/{MODEL}/ready")[1])["ad_table"]["ads"] == len(world.ads) + 1 and r)  # fmt: skip
        assert ready["ready"] and not ready["ad_table"]["stale"]
        status, answer = post(f"{base}/v1/models/{MODEL}:predict",
                              v1_body(1, [0, new_ad], {"request_ts": float(REQUEST_TS)}))  # fmt: skip
        assert status == 200 and answer["fallback"]["unknown_ads"] == 0, answer
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
