"""Train = serve on a live-streamed mini-day: the features a real ranker logged while a day's events streamed
through the real collector equal, feature by feature, what the training-set builder gives the same impressions
once the day has been ingested from the collector's export; and the scores it answered equal the model's scores
on the training set's features for those impressions.

Three days are landed and ingested for real (GX gate, offline store, Feast push), a small ranker is trained on
them; the fourth day streams live (``serving.live_day.replay_day``: the ``land-synthetic --live`` streamer) while
each impression's user is ranked at the impression's time, ``fresh_delay_s`` (1 s) after its batch was sent.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from features.ingest import IngestConfig, ingest
from features.training_sets import TrainingSetConfig, build_training_set
from gemflow.config import load_config
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.training.train import train
from serving.feature_log import TABLE
from serving.live_day import ReplayConfig, replay_day, served_vs_trained
from serving.skew_check import read_served, skew_check
from tests.features.helpers import ADS, DAY0, ads_frame, events_frame, land_days, to_arrow, users_frame
from tests.ports import free_port
from tests.serving.events.collector import running
from tests.serving.events.test_collector import exported_ids
from tests.serving.world import running_server

pytestmark = pytest.mark.integration  # four real ingests, a training, two servers (~2 min)

DAYS = 3
LIVE_DAY = DAY0 + dt.timedelta(days=DAYS)
RECENT = 16


def test_a_live_days_served_features_and_scores_equal_the_training_builders(tmp_path):
    ws = Workspace(tmp_path / "ws")
    land_days(ws, DAYS)
    for k in range(DAYS):
        ingest(ws, DAY0 + dt.timedelta(days=k), IngestConfig(gate={"data_docs": False}))
    last = DAY0 + dt.timedelta(days=DAYS - 1)
    build_training_set(ws, TrainingSetConfig(name="t", start=DAY0.isoformat(), end=last.isoformat()))
    overrides = {"model": "ranker", "training_set": "t", "output_dir": str(tmp_path / "run"), "optim.epochs": 1,
                 "ranker.d_model": 16, "ranker.num_heads": 2, "ranker.recent_events": RECENT,
                 "ranker.use_user_tokens": False, "tracking.enabled": False}  # fmt: skip
    run_dir = train(load_config(TrainRunConfig, None, overrides), ws).run_dir
    # the live day's users and ads snapshots land first, as a lander's do
    for table, frame in (("users", users_frame(LIVE_DAY)), ("ads", ads_frame(LIVE_DAY))):
        folder = ws.raw(table, LIVE_DAY)
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(to_arrow(table, frame), folder / "part-00000.parquet")
    events = events_frame(LIVE_DAY, n=120)
    events["ts"] += pd.Timedelta(microseconds=123_457)  # request times with a fraction, as an ad server's are
    day = to_arrow("events", events)

    server_settings = ("feature_log.sample_rate=1.0", "limits.request_ts_max_age_days=3650")
    with (
        running_server(SimpleNamespace(ws=ws, model_path=run_dir / "model.pt"), free_port(), tmp_path / "serve.log",
                       *server_settings) as ranker,
        running(ws, tmp_path / "collector.log", "recent_events=64") as collector,
    ):  # fmt: skip
        replay = replay_day(day, np.array(list(ADS)), collector.url, ranker,
                            ReplayConfig(rate=60, rank_rate=1000, candidates=len(ADS), lag_s=1.0))  # fmt: skip
        deadline = time.monotonic() + 30
        while len(exported_ids(ws)) < day.num_rows:
            assert time.monotonic() < deadline, f"exported {len(exported_ids(ws))} of {day.num_rows} events"
            time.sleep(0.2)
    ranked = replay.ranked
    impressions = int((day.column("action").to_numpy(zero_copy_only=False) == "impression").sum())
    assert replay.streamed["accepted"] == day.num_rows and len(ranked) == impressions
    assert (ranked["reasons"] == "").all(), ranked["reasons"].value_counts()

    # the day ingested from the collector's export alone, a training set through it
    summary = ingest(ws, LIVE_DAY, IngestConfig(gate={"data_docs": False}))
    assert summary["tables"]["events"]["accepted"] == day.num_rows
    build_training_set(ws, TrainingSetConfig(name="t2", start=DAY0.isoformat(), end=LIVE_DAY.isoformat()))
    logged = list(ws.offline(TABLE, LIVE_DAY).glob("*.parquet"))
    assert sum(pq.read_metadata(f).num_rows for f in logged) == len(ranked)

    # the windows served hold events that reached the store only through the live path (the day was not ingested)
    served = read_served(ws, [LIVE_DAY])
    day_start = dt.datetime.combine(LIVE_DAY, dt.time(), tzinfo=dt.UTC).timestamp()
    assert served["recent_ts"].map(lambda ts: sum(t >= day_start for t in ts)).sum() > len(ranked)
    report = skew_check(ws, ws.training("t2"), [LIVE_DAY])
    assert report["rows"] == len(ranked)
    mismatches = {name: f["mismatches"] for name, f in report["features"].items() if f["mismatches"]}
    assert mismatches == {}, json.dumps(report, indent=2)

    quality = served_vs_trained(ranked, run_dir, ws.training("t2"))
    assert quality["impressions"] == len(ranked) and quality["not_in_training_set"] == 0
    assert quality["score_abs_diff"]["max"] < 1e-5, json.dumps(quality, indent=2)
    assert quality["served"]["ne"] == pytest.approx(quality["trained_features"]["ne"], abs=1e-5)
