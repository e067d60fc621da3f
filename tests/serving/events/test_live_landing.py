"""``gemflow land-synthetic --live RATE``: a synthetic day streamed through the live event path, then ingested."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys

import pytest

from features import recent_events
from features.histories import build_histories
from features.ingest import ingest
from features.stats import read_events
from features.store import open_store
from gemflow.workspace import Workspace
from tests.serving.events.collector import N, ingest_config, running
from tests.serving.events.test_collector import wait_exported

pytestmark = pytest.mark.integration
SMALL = ("num_users=40", "num_ads=60", "num_advertisers=8", "num_categories=5", "events_per_user_day=6")


def test_a_day_streamed_live_lands_in_the_online_lists_and_the_raw_log(tmp_path):
    ws = Workspace(tmp_path / "ws")
    day = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=1)
    with running(ws, tmp_path / "collector.log", "ads_reload_s=0") as c:
        cmd = [sys.executable, "-m", "gemflow.cli", "land-synthetic", "--date", day.isoformat(),
               "--epoch", day.isoformat(), "--live", "3000", "--events-url", c.url, "-w", str(ws.root)]  # fmt: skip
        for setting in SMALL:
            cmd += ["--set", setting]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        streamed = out["live"]
        assert streamed["events"] > 100 and streamed["accepted"] == streamed["events"]
        assert streamed.get("rejected", 0) == 0 and not ws.raw("events", day).exists()
        events = read_events_raw_count(ws, day)
        wait_exported(ws, events)
    summary = ingest(ws, day, ingest_config())
    assert summary["tables"]["events"]["accepted"] == streamed["events"]
    assert summary["tables"]["events"]["quarantined"] == 0
    history = read_events(ws, [day])
    hist = build_histories(history)
    store = open_store(ws, ingest_config().feature_store)
    online, _ = recent_events.read_online(store, hist.user_ids)
    for row, user in enumerate(hist.user_ids.tolist()):
        lo, hi = hist.offsets[row], hist.offsets[row + 1]
        mine = online[online["user_id"] == user]
        assert mine["ad_id"].tolist() == hist.values["ad_id"][lo:hi][-N:].tolist()
        assert mine["action"].tolist() == hist.values["action"][lo:hi][-N:].tolist()


def read_events_raw_count(ws, day) -> list[int]:
    """The event ids the collector logged (what its export must hold)."""
    import pandas as pd

    from serving.events.log import EventLog

    return pd.read_sql("SELECT event_id FROM events", EventLog(ws.root / "events" / "events.db").conn)[
        "event_id"
    ].tolist()
