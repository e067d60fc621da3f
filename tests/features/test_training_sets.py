"""Training sets: examples + jagged histories + point-in-time features equal a hand-written as-of join."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from features.schema import ONLINE_LIST_EVENTS
from features.training_sets import EXAMPLE_COLUMNS, TrainingSetConfig, build_training_set
from features.vocabulary import load_vocabularies
from gemflow.cli import app
from tests.features.helpers import ADS, DAY0, ads_frame, events_frame, publish_without_gate, users_frame

DAYS = [DAY0 + dt.timedelta(days=k) for k in range(3)]


@pytest.fixture
def landed(workspace):
    frames = {
        d: {"users": users_frame(d), "ads": ads_frame(d), "events": events_frame(d, n=50)} for d in DAYS
    }
    publish_without_gate(workspace, frames)
    events = pd.concat([f["events"] for f in frames.values()], ignore_index=True)
    return workspace, events


def _config(**kw) -> TrainingSetConfig:
    return TrainingSetConfig(name="t", start=DAYS[0].isoformat(), end=DAYS[-1].isoformat(), **kw)


def test_files_columns_and_manifest(landed):
    ws, events = landed
    manifest = build_training_set(ws, _config())
    out = ws.training("t")
    assert sorted(manifest["files"]) == [
        "examples.parquet",
        "items.parquet",
        "ranker.parquet",
        "sequences.parquet",
    ]
    items = pq.read_table(out / "items.parquet").to_pandas()  # every ad of the last day, all its attributes
    assert list(items.columns) == ["ad_id", "advertiser_id", "category_id", "categories"]
    assert items["ad_id"].is_monotonic_increasing and set(events["ad_id"]) <= set(items["ad_id"])
    assert all(c in list(cats) for c, cats in zip(items["category_id"], items["categories"], strict=True))
    examples = pq.read_table(out / "examples.parquet").to_pandas()
    sequences = pq.read_table(out / "sequences.parquet")
    assert list(examples.columns) == list(EXAMPLE_COLUMNS)
    assert sequences.column_names == [
        "user_id",
        "ad_id",
        "action",
        "surface",
        "category_id",
        "advertiser_id",
        "ts",
    ]
    impressions = events[events.action == "impression"]
    assert sorted(examples.example_id) == sorted(impressions.event_id)
    assert (
        manifest["counts"]["events"]
        == len(events)
        == sum(len(x) for x in sequences.column("ad_id").to_pylist())
    )
    day_of = {d.isoformat(): s for d, s in zip(DAYS, ("train", "valid", "test"), strict=True)}
    expected_split = impressions.set_index("event_id").ts.dt.date.astype(str).map(day_of)
    assert (examples.set_index("example_id").split == expected_split.loc[examples.example_id]).all()
    # model tables hold the ids of the training period (the first day), whatever their values
    train_events = events[events.ts.dt.date == DAYS[0]]
    assert manifest["vocab_sizes"]["ad_id"] == train_events.ad_id.nunique()
    assert manifest["vocab_sizes"]["user_id"] == train_events.user_id.nunique()
    vocabularies = load_vocabularies(out)
    assert sorted(vocabularies["ad_id"].ids) == sorted(train_events.ad_id.unique())
    assert manifest["vocab_sizes"]["action"] == 8
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["counts"] == manifest["counts"]


def test_no_history_reaches_its_example(landed):
    ws, events = landed
    build_training_set(ws, _config(join_features=False))
    out = ws.training("t")
    examples = pq.read_table(out / "examples.parquet").to_pandas()
    seq = pq.read_table(out / "sequences.parquet")
    ts_lists, ad_lists = seq.column("ts").to_pylist(), seq.column("ad_id").to_pylist()
    user_ids = seq.column("user_id").to_pylist()
    for ex in examples.itertuples():
        assert user_ids[ex.user_row] == ex.user_id
        history = np.array(ts_lists[ex.user_row])
        assert np.all(history[: ex.cut] < ex.ts), "an event at or after the example leaked into its history"
        # Same count as the raw events strictly before the example's second (independent of the sort).
        strictly_before = (events.user_id == ex.user_id) & (
            events.ts < pd.Timestamp(ex.ts, unit="s", tz="UTC")
        )
        assert ex.cut == int(strictly_before.sum())
        assert ad_lists[ex.user_row][: ex.cut] == (
            events[strictly_before].sort_values(["ts", "event_id"]).ad_id.tolist()
        )


def test_ranker_features_equal_a_hand_written_as_of_join(landed):
    ws, events = landed
    build_training_set(ws, _config())
    ranker = pq.read_table(ws.training("t") / "ranker.parquet").to_pandas().set_index("example_id")
    impressions = events[events.action == "impression"]
    for ev in impressions.itertuples():
        row = ranker.loc[ev.event_id]
        day = ev.ts.date()
        day_start = pd.Timestamp(day, tz="UTC")
        # ad stats as of the end of the previous day: only impressions of earlier days count
        earlier = impressions[(impressions.ad_id == ev.ad_id) & (impressions.ts < day_start)]
        last_day = earlier[earlier.ts >= day_start - pd.Timedelta(days=1)]
        if day == DAYS[0]:
            assert pd.isna(row.impressions_1d) and row.recent_ad_ids is None
        else:
            assert row.impressions_1d == len(last_day)
            assert row.impressions_7d == len(earlier)
            assert row.clicks_7d == earlier.click.sum()
            mine = events[(events.user_id == ev.user_id) & (events.ts < day_start)].sort_values(
                ["ts", "event_id"]
            )
            expected_recent = mine.ad_id.tolist()[-ONLINE_LIST_EVENTS:]
            assert (list(row.recent_ad_ids) if row.recent_ad_ids is not None else []) == expected_recent
            if row.recent_ad_ids is not None:  # the per-event fields serving reads, aligned with the ads
                assert list(row.recent_advertiser_ids) == [ADS[a][0] for a in expected_recent]
                assert len(row.recent_surfaces) == len(expected_recent)
        assert row.ad_quality == pytest.approx(ADS[ev.ad_id][2])
        assert row.user_age == {1: 25, 2: 40, 3: 61}[ev.user_id]
        assert row.user_embedding is None and row.model_version is None


def test_bad_ranges_are_clear_errors(landed):
    ws, _ = landed
    with pytest.raises(FileNotFoundError, match="no accepted event partitions"):
        build_training_set(ws, TrainingSetConfig(name="x", start="2027-01-01", end="2027-01-02"))
    with pytest.raises(ValueError, match="no train days"):
        build_training_set(
            ws, TrainingSetConfig(name="x", start=DAYS[2].isoformat(), end=DAYS[2].isoformat())
        )
    with pytest.raises(ValueError, match="dates like"):
        build_training_set(ws, TrainingSetConfig(name="x", start="yesterday", end="today"))


def test_cli_build_training_set(landed):
    ws, _ = landed
    result = CliRunner().invoke(
        app,
        [
            "build-training-set",
            "--start",
            DAYS[0].isoformat(),
            "--end",
            DAYS[-1].isoformat(),
            "--name",
            "cli",
            "--workspace",
            str(ws.root),
            "--set",
            "join_features=false",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (ws.training("cli") / "examples.parquet").exists()
    assert (ws.training("cli") / "config.yaml").exists()
