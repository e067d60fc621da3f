"""The one recent-events merge, and the daily ingest's online push going through it."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from features import recent_events
from features.ingest import IngestConfig, ingest
from features.ingestion.online import PUSH_USERS
from features.stats import micros, read_events
from features.store import open_store
from tests.features.helpers import DAY0, write_raw


def events(rows) -> pd.DataFrame:
    """(user, event_id, ts_us) -> long-form events with the other fields derived from the id."""
    frame = pd.DataFrame(rows, columns=["user_id", "event_id", "ts_us"])
    for i, col in enumerate(("ad_id", "action", "category_id", "surface", "advertiser_id")):
        frame[col] = frame["event_id"] * 10 + i
    return frame[list(recent_events.EVENT_COLUMNS)]


def test_merge_keeps_the_newest_n_in_history_order_and_counts_a_repeated_id_once():
    existing = events([(1, 5, 100), (1, 6, 200), (2, 9, 50)])
    new = events([(1, 7, 150), (1, 6, 200), (1, 3, 200), (1, 8, 300), (3, 1, 10)])
    merged = recent_events.merge(existing, new, n=3)
    by_user = {u: g["event_id"].tolist() for u, g in merged.groupby("user_id")}
    # user 1: (100,5) (150,7) (200,3) (200,6) (300,8) -> newest 3; the tie at ts 200 is broken by event id
    assert by_user == {1: [3, 6, 8], 2: [9], 3: [1]}
    assert merged.loc[merged["event_id"] == 6, "ad_id"].item() == 60
    # idempotent: merging the result with the same events again changes nothing
    again = recent_events.merge(merged, new, n=3)
    pd.testing.assert_frame_equal(again, merged)


def test_view_rows_round_trip_and_time_gaps():
    merged = recent_events.merge(
        recent_events.empty_events(), events([(4, 1, 1_500_000), (4, 2, 2_000_000)]), 8
    )
    table = recent_events.view_rows(merged, 3_000_000)
    row = table.to_pylist()[0]
    assert row["recent_event_ids"] == [1, 2] and row["recent_ts"] == [1, 2]
    assert row["recent_time_gaps"] == [1.5, 1.0]
    pd.testing.assert_frame_equal(recent_events.from_view_rows(table), merged)


def _online_lists(store, users) -> dict[int, list[int]]:
    existing, _ = recent_events.read_online(store, users)
    return {int(u): g["event_id"].tolist() for u, g in existing.groupby("user_id")}


# 2: the day's users merged and pushed a few at a time
@pytest.mark.parametrize("push_users", [PUSH_USERS, 2])
def test_daily_push_merges_and_keeps_live_events_newer_than_the_day(workspace, monkeypatch, push_users):
    monkeypatch.setattr("features.ingestion.online.PUSH_USERS", push_users)
    cfg = IngestConfig(gate={"data_docs": False}, recent_events=6)
    write_raw(workspace, DAY0)
    ingest(workspace, DAY0, cfg)
    store = open_store(workspace, cfg.feature_store)
    history = read_events(workspace, [DAY0])
    users = sorted(history["user_id"].unique().tolist())
    daily = {u: g["event_id"].tolist()[-6:] for u, g in history.groupby("user_id")}
    assert _online_lists(store, users) == daily

    # A live event of user 1 the next morning, then DAY0 ingested again: the re-run keeps it.
    live_ts = micros(pd.Series([pd.Timestamp(DAY0 + dt.timedelta(days=1), tz="UTC")]))[0] + 3_600_000_000
    live = events([(1, 777_777, live_ts)])
    recent_events.merge_online(store, live, 6, int(live_ts))
    ingest(workspace, DAY0, cfg)
    store = open_store(workspace, cfg.feature_store)
    online = _online_lists(store, users)
    assert online[1] == [*daily[1], 777_777][-6:]
    assert {u: v for u, v in online.items() if u != 1} == {u: v for u, v in daily.items() if u != 1}
    # the merged row is not stamped before the live row it replaced (1 µs after it: Feast's Redis writer skips a
    # row that is not newer; SQLite keeps whole seconds)
    _, stamps = recent_events.read_online(store, [1])
    assert stamps[1] >= live_ts


def test_recent_events_table_rows_match_the_merge(workspace):
    cfg = IngestConfig(gate={"data_docs": False}, materialize=False, push_recent_events=False)
    write_raw(workspace, DAY0)
    ingest(workspace, DAY0, cfg)
    table = pq.read_table(next(workspace.offline("user_recent_events", DAY0).glob("*.parquet")))
    history = read_events(workspace, [DAY0]).sort_values(["user_id", "ts_us", "event_id"])
    for row in table.to_pylist():
        mine = history[history["user_id"] == row["user_id"]].tail(cfg.recent_events)
        assert row["recent_event_ids"] == mine["event_id"].tolist()
        assert row["recent_ts_us"] == mine["ts_us"].tolist()
        assert row["recent_ad_ids"] == mine["ad_id"].tolist()
        assert row["recent_advertiser_ids"] == mine["advertiser_id"].tolist()
        assert np.all(np.diff(row["recent_ts_us"]) >= 0)
