"""The live event path end to end, on data the pipeline itself wrote: a real ``gemflow events serve`` process,
the SQLite online store, the raw-log export and the daily ingest reading it."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pandas as pd
import pytest

from features import recent_events
from features.histories import build_histories
from features.ingest import ingest
from features.stats import read_events
from features.store import open_store
from serving.events.export import LIVE_TABLE
from serving.events.log import EventLog
from tests.features.helpers import DAY0, events_frame, write_raw
from tests.serving.events.collector import DAY1, N, as_json, ingest_config, prepare, running

pytestmark = pytest.mark.integration
TOKEN = "s3cret-token"


def online_lists(ws, users) -> dict[int, pd.DataFrame]:
    store = open_store(ws, ingest_config().feature_store)
    existing, _ = recent_events.read_online(store, users)
    return {int(u): g.reset_index(drop=True) for u, g in existing.groupby("user_id")}


def exported_ids(ws) -> list[int]:
    files = sorted(ws.raw(LIVE_TABLE).glob("date=*/*.parquet"))
    return sorted(pd.concat([pd.read_parquet(f) for f in files])["event_id"].tolist()) if files else []


def wait_exported(ws, ids, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while exported_ids(ws) != sorted(ids):
        assert time.monotonic() < deadline, f"exported {len(exported_ids(ws))} of {len(ids)} events"
        time.sleep(0.2)


def test_bad_events_are_refused_by_name_and_quarantined_and_valid_ones_kept(tmp_path):
    ws_root = tmp_path / "ws"
    from gemflow.workspace import Workspace

    ws = Workspace(ws_root)
    prepare(ws)
    good = as_json(events_frame(DAY1, n=4))
    bad_action = {**good[1], "event_id": 99_001, "action": "teleport"}
    unknown_ad = {**good[1], "event_id": 99_002, "ad_id": 424242}
    labels = {**good[1], "event_id": 99_003, "action": "view", "click": 1, "conversion": 0}
    naive_ts = {**good[1], "event_id": 99_004, "ts": "2026-01-06T10:00:00"}
    with running(ws, tmp_path / "collector.log", env={"GEMFLOW_EVENTS_TOKEN": TOKEN}) as c:
        assert c.post(good[0]).status_code == 401
        assert c.post(good[0], token="wrong").status_code == 401
        r = c.post({"events": [good[0], bad_action, unknown_ad, good[1], labels, naive_ts]}, token=TOKEN)
        assert r.status_code == 422
        body = r.json()
        assert body["accepted"] == 2 and [x["index"] for x in body["rejected"]] == [1, 2, 4, 5]
        reasons = [x["reason"] for x in body["rejected"]]
        assert reasons == [
            "expect_column_values_to_be_in_set(action)",
            "expect_column_values_to_be_in_reference(ad_id)[ads]",
            "expect_column_values_to_be_in_set(click)[non_impression]",
            "expect_column_values_to_match_regex(ts)[timestamp]",
        ]
        assert "teleport" in body["error"]
        # one id, other content: refused as the gate's duplicate, the first copy stays
        r = c.post({**good[0], "ad_id": 13}, token=TOKEN)
        assert r.status_code == 422 and r.json()["rejected"][0]["reason"].startswith(
            "expect_column_values_to_be_unique"
        )
        bad = c.post(content=b'{"event_id": 1,', token=TOKEN)
        assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]
        huge = c.post({"events": [good[0]] * 5000}, token=TOKEN)
        assert huge.status_code == 413
        assert c.post([1, 2], token=TOKEN).status_code == 400
        metrics = c.get("/metrics").text
        assert 'gemflow_events_total{outcome="rejected"} 5.0' in metrics
    quarantined = EventLog(ws.root / "events" / "events.db").quarantined()
    # the four refused events, then the copy that reused a logged id with other content
    assert [q["reason"] for q in quarantined] == [*reasons, "expect_column_values_to_be_unique(event_id)"]
    assert quarantined[0]["payload"]["action"] == "teleport"
    online = online_lists(ws, [good[0]["user_id"], good[1]["user_id"]])
    kept = {int(i) for g in online.values() for i in g["event_id"]}
    assert {good[0]["event_id"], good[1]["event_id"]} <= kept and not kept & {99_001, 99_002, 99_003, 99_004}


def test_online_lists_equal_the_histories_ingest_builds_from_the_raw_log(tmp_path):
    """Streamed with retries, concurrent events of one user and out-of-order / late events; then the daily ingest
    of the exported log, and a batch landing of the same events on top: no event lost or counted twice."""
    from gemflow.workspace import Workspace

    ws = Workspace(tmp_path / "ws")
    prepare(ws)
    day1 = events_frame(DAY1, n=60, seed=3)
    events = as_json(day1)
    rng = np.random.default_rng(0)
    shuffled = [events[i] for i in rng.permutation(len(events))]  # out of order, late ones included
    batches = [shuffled[i : i + 7] for i in range(0, len(shuffled) - 10, 7)]
    singles = shuffled[len(batches) * 7 :]
    with running(ws, tmp_path / "collector.log") as c:
        # two events of one user at the same moment
        user1 = [e for e in singles if e["user_id"] == 1][:2] or [e for e in events if e["user_id"] == 1][:2]
        barrier = threading.Barrier(len(user1))

        def at_once(event):
            barrier.wait()
            return c.post(event).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(at_once, user1)) == [200] * len(user1)
            codes = list(pool.map(lambda b: c.post({"events": b}).status_code, batches + batches[:3]))
            codes += list(pool.map(lambda e: c.post(e).status_code, singles))
        assert codes == [200] * len(codes)
        retry = c.post({"events": batches[0]})  # a client retrying a batch: counted once
        assert retry.status_code == 200 and retry.json() == {
            "accepted": len(batches[0]),
            "duplicates": len(batches[0]),
        }
        wait_exported(ws, [e["event_id"] for e in events])
        metrics = c.get("/metrics").text
        assert f'gemflow_events_total{{outcome="accepted"}} {float(len(events))}' in metrics

    users = sorted(set(day1["user_id"]))
    live = online_lists(ws, users)
    summary = ingest(ws, DAY1, ingest_config())
    assert summary["tables"]["events"]["accepted"] == len(events)
    assert summary["tables"]["events"]["quarantined"] == 0
    assert_lists_are_history_tails(ws, live)
    assert_lists_are_history_tails(ws, online_lists(ws, users))

    # the same events landed by a batch source too: ingest counts each once
    write_raw(ws, DAY1, day1)
    summary = ingest(ws, DAY1, ingest_config())
    assert summary["tables"]["events"]["accepted"] == len(events)
    assert summary["tables"]["events"]["quarantined"] == 0
    assert_lists_are_history_tails(ws, online_lists(ws, users))


def assert_lists_are_history_tails(ws, lists: dict[int, pd.DataFrame]) -> None:
    events = read_events(ws, [DAY0, DAY1])
    histories = build_histories(events)
    ordered = events.sort_values(["user_id", "ts_us", "event_id"])
    assert sorted(lists) == histories.user_ids.tolist()
    for row, user in enumerate(histories.user_ids.tolist()):
        lo, hi = histories.offsets[row], histories.offsets[row + 1]
        mine = lists[user]
        for field, column in (("ad_id", "ad_id"), ("action", "action"), ("surface", "surface"),
                              ("category_id", "category_id"), ("advertiser_id", "advertiser_id")):  # fmt: skip
            assert mine[column].tolist() == histories.values[field][lo:hi][-N:].tolist(), (user, field)
        assert (mine["ts_us"] // 1_000_000).tolist() == histories.values["ts"][lo:hi][-N:].tolist()
        assert mine["event_id"].tolist() == ordered[ordered["user_id"] == user]["event_id"].tolist()[-N:]
