"""Train = serve for the ranker's user side, on an online store the pipeline itself wrote.

Raw days are landed and ingested for real (GX gate, offline store, Feast push of ``user_recent_events``), a
training set is built from the same offline store, and then, at a request time just after the last ingested
day, every user's fresh events as the server builds them from its online read (``serving.inputs``) equal what
training reads for that user at that time (``TrainingSet.events_at`` with the ranker's ``fresh_delay_s``); and a
ranker trained on that set, served for real, logs what it scored with, which ``gemflow skew-check`` finds equal
to the training-set builder's features, feature by feature.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from features.feature_repo.offline import day_end
from features.ingest import IngestConfig, ingest
from features.store import open_store
from features.training_sets import TrainingSetConfig, build_training_set
from gemflow.config import load_config
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.training.data import TrainingSet
from models.training.dense import DenseSpec
from models.training.train import train
from serving import inputs
from serving.ad_table import AdSnapshot
from serving.client import post, v1_body
from serving.feature_log import EVENT_FIELDS, SCHEMA, TABLE
from serving.id_rows import IdRows
from serving.predictor import USER_SERVICE
from serving.skew_check import read_served, skew_check
from serving.user_features import parse_online_row
from tests.features.helpers import ADS, DAY0, USERS, land_days
from tests.ports import free_port
from tests.serving.world import running_server

pytestmark = pytest.mark.integration  # three real ingests (~1 min)

DAYS = 3
RECENT, BUCKETS = 16, 32  # a window shorter than most users' histories: the cut matters
REQUEST_TS = day_end(DAY0 + dt.timedelta(days=DAYS - 1)).timestamp() + 1.5  # the store: as of the day's end


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> tuple[Workspace, TrainingSet]:
    ws = Workspace(tmp_path_factory.mktemp("fresh") / "ws")
    land_days(ws, DAYS)
    for k in range(DAYS):
        ingest(ws, DAY0 + dt.timedelta(days=k), IngestConfig(gate={"data_docs": False}))
    last = DAY0 + dt.timedelta(days=DAYS - 1)
    build_training_set(ws, TrainingSetConfig(name="t", start=DAY0.isoformat(), end=last.isoformat()))
    return ws, TrainingSet(ws.training("t"))


def _served(ws: Workspace) -> dict:
    """Every user's features as the server reads them: its feature service, one online row each."""
    store = open_store(ws)
    service = store.get_feature_service(USER_SERVICE)
    return {
        user: parse_online_row(
            store.get_online_features(features=service, entity_rows=[{"user_id": user}]).to_dict()
        )
        for user in USERS
    }


@pytest.mark.parametrize("delay_s", [0, 1, 5 * 3600])
def test_served_fresh_events_equal_what_training_reads_at_the_same_time(pipeline, delay_s):
    ws, data = pipeline
    served = _served(ws)
    user_ids = pq.read_table(ws.training("t") / "sequences.parquet", columns=["user_id"])["user_id"]
    row_of = {int(u): i for i, u in enumerate(user_ids.to_numpy())}
    request_ts = REQUEST_TS
    # the ad table of a server whose model was trained on this set: its vocabulary maps the events' ad ids
    no_ads = inputs.AdArrays.build(AdSnapshot.from_rows([], {}, None), DenseSpec([], [], []),
                                   IdRows.of(data.vocabularies))  # fmt: skip
    compared = 0
    for user in USERS:
        row = np.array([row_of[user]])
        trained = data.events_at(row, data.seq_lengths[row], np.array([request_ts]), RECENT, BUCKETS,
                                 gap_to="request", fresh_delay_s=delay_s)  # fmt: skip
        events, filled = inputs.recent_events(served[user], no_ads, request_ts, RECENT, BUCKETS, delay_s)
        assert not filled
        for f in fields(trained):
            a, b = getattr(trained, f.name), getattr(events, f.name)
            assert a.dtype == b.dtype and torch.equal(a, b), f"user {user}, {f.name}: {a} != {b}"
        compared += trained.lengths.item()
    assert compared > 0
    if delay_s > 3600:  # the delay reaches back into the last day: events the store holds are left out
        whole = data.events_at(np.arange(data.num_users), data.seq_lengths, np.full(data.num_users, request_ts),
                               10**6, BUCKETS, gap_to="request")  # fmt: skip
        assert (whole.ts >= int(request_ts) - delay_s).any()


def test_a_served_rankers_logged_features_equal_the_training_builders(pipeline, tmp_path):
    ws, _ = pipeline
    overrides = {"model": "ranker", "training_set": "t", "output_dir": str(tmp_path / "run"), "optim.epochs": 1,
                 "ranker.d_model": 16, "ranker.num_heads": 2, "ranker.recent_events": RECENT,
                 "ranker.use_user_tokens": False, "tracking.enabled": False}  # fmt: skip
    ranker = train(load_config(TrainRunConfig, None, overrides), ws).run_dir / "model.pt"
    settings = ("feature_log.sample_rate=1.0", "feature_log.flush_rows=1")
    with running_server(SimpleNamespace(ws=ws, model_path=ranker), free_port(), tmp_path / "serve.log",
                        *settings) as base:  # fmt: skip
        for user in (*USERS, 999):  # 999: a user the store and the training set do not know
            body = v1_body(user, list(ADS), {"request_ts": REQUEST_TS})
            status, answer = post(f"{base}/v1/models/gem-ranker:predict", body)
            assert status == 200, answer
        deadline = time.monotonic() + 30
        while len(list(ws.offline(TABLE).glob("date=*/*.parquet"))) < len(USERS) + 1:
            assert time.monotonic() < deadline, "the served rows were not written"
            time.sleep(0.2)
    report = skew_check(ws, ws.training("t"))
    assert report["rows"] == len(USERS) + 1
    assert report["fresh_delay_s"] == [TrainRunConfig().ranker.fresh_delay_s]
    assert {name: f["mismatches"] for name, f in report["features"].items() if f["mismatches"]} == {}, (
        json.dumps(report, indent=2)
    )
    served = read_served(ws)
    assert served["recent_ad_ids"].map(len).sum() > 0 and (served["user_gender"] >= 0).sum() == len(USERS)
    # a served row that differs (one event less, as if the event path had lost it) is found, and only there
    file = next(f for f in ws.offline(TABLE).glob("date=*/*.parquet")
                if len(pq.read_table(f)["recent_ad_ids"][0]) > 1)  # fmt: skip
    row = pq.read_table(file).to_pylist()[0]
    for name in EVENT_FIELDS:
        row[name] = row[name][1:]
    pq.write_table(pa.Table.from_pylist([row], schema=SCHEMA), file)
    skewed = skew_check(ws, ws.training("t"))["features"]
    assert {name: f["mismatches"] for name, f in skewed.items() if f["mismatches"]} == dict.fromkeys(
        EVENT_FIELDS, 1
    )
