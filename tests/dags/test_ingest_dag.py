"""The ingestion DAG runs for two consecutive logical dates (``dag.test()`` in the Airflow environment, each task
calling the project CLI) and leaves both partitions in the offline store and fresh features online."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import pandas as pd
import pytest

from features.schema import ONLINE_LIST_EVENTS
from features.sources.synthetic import SyntheticConfig, generate
from features.store import open_store
from gemflow.workspace import Workspace
from tests.dags.airflow_env import DAGS, migrate, require_airflow, run_airflow_python

pytestmark = pytest.mark.integration
DAYS = (dt.date(2026, 1, 1), dt.date(2026, 1, 2))

RUN_DAG = f"""
import datetime as dt, json
from airflow.dag_processing.dagbag import BundleDagBag
dag = BundleDagBag(dag_folder={str(DAGS)!r}, bundle_path={str(DAGS)!r}).dags["gemflow_ingest"]
states = {{}}
for day in {[d.isoformat() for d in DAYS]!r}:
    run = dag.test(logical_date=dt.datetime.fromisoformat(day).replace(tzinfo=dt.UTC))
    states[day] = str(run.state)
print(json.dumps(states))
"""


def test_ingest_dag_two_consecutive_dates(tmp_path: Path):
    require_airflow()
    ws = Workspace(tmp_path / "ws")
    generate(
        SyntheticConfig(num_users=200, num_ads=150, days=2, start_date=DAYS[0].isoformat()),
        ws,
        progress=False,
    )
    env = migrate(tmp_path / "airflow")
    env.update(GEMFLOW_HOME=str(ws.root), GEMFLOW_BIN=str(Path(sys.executable).parent / "gemflow"))

    states = run_airflow_python(RUN_DAG, env, timeout=900)
    assert states == {d.isoformat(): "success" for d in DAYS}

    for day in DAYS:
        raw = pd.read_parquet(ws.raw("events", day))
        accepted = pd.read_parquet(ws.offline("events", day))
        assert len(accepted) == len(raw) > 0  # clean synthetic data: nothing quarantined
        assert (ws.reports(day) / "events" / "summary.json").exists()

    store = open_store(ws)
    user = int(accepted["user_id"].value_counts().index[0])
    ad = int(accepted.loc[accepted["action"] == "impression", "ad_id"].value_counts().index[0])
    online = store.get_online_features(
        features=["user_recent_events:recent_ad_ids", "user_recent_events:recent_actions"],
        entity_rows=[{"user_id": user}],
    ).to_dict()
    recent = online["recent_ad_ids"][0]
    assert recent, "no recent events online for the most active user"
    expected = (
        pd.concat([pd.read_parquet(ws.offline("events", d)) for d in DAYS])
        .query("user_id == @user")
        .sort_values(["ts", "event_id"])["ad_id"]
        .tail(ONLINE_LIST_EVENTS)
        .tolist()
    )
    assert recent == expected
    stats = store.get_online_features(
        features=["ad_stats:impressions_1d", "ad_stats:clicks_7d"], entity_rows=[{"ad_id": ad}]
    ).to_dict()
    assert stats["impressions_1d"][0] and stats["impressions_1d"][0] > 0
