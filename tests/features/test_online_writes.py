"""The fast online writer leaves the real SQLite / Redis store exactly as Feast's own materialize and push do."""

from __future__ import annotations

import datetime as dt
import sqlite3

import pandas as pd
import pyarrow as pa
import pytest
from feast.data_source import PushMode

from features.feature_repo import USER_EMBEDDING_PUSH, FeatureStoreConfig
from features.feature_repo import online as online_writes
from features.feature_repo.tables import CREATED_TS, EVENT_TS
from features.ingest import IngestConfig
from features.store import open_store
from gemflow.workspace import Workspace
from tests.features.helpers import (
    ADS,
    DAY0,
    USERS,
    ads_frame,
    events_frame,
    publish_without_gate,
    users_frame,
)
from tests.features.test_redis_store import redis_url  # noqa: F401  (the module's private redis-server)

DAYS = (DAY0, DAY0 + dt.timedelta(days=1))
USER_ROWS = [{"user_id": u} for u in (*USERS, 99)]  # 99: unknown
AD_ROWS = [{"ad_id": a} for a in (*ADS, 999)]


def _publish(ws: Workspace, cfg: IngestConfig) -> None:
    """Two days, then the first again (a backfill: refreshes and re-publishes the second day), then embeddings
    (a view with a String feature: the fast path hands it to Feast) and a stale embedding row."""
    frames = {d: {"users": users_frame(d), "ads": ads_frame(d), "events": events_frame(d)} for d in DAYS}
    publish_without_gate(ws, frames, cfg)
    publish_without_gate(ws, {DAYS[0]: frames[DAYS[0]]}, cfg)
    store = open_store(ws, cfg.feature_store)
    stamp = pd.Timestamp(DAYS[1], tz="UTC")
    for when in (stamp, stamp - pd.Timedelta(days=3)):
        rows = pd.DataFrame(
            {
                "user_id": [1, 2],
                "user_embedding": [[0.5, -1.25], [when.day / 7, 2.0]],
                "model_version": ["user-model/1", "user-model/1"],
                EVENT_TS: [when, when],
                CREATED_TS: [when, when],
            }
        )
        if cfg.online_writer == "fast":
            online_writes.push(store, USER_EMBEDDING_PUSH, pa.Table.from_pandas(rows, preserve_index=False))
        else:
            store.push(USER_EMBEDDING_PUSH, rows, to=PushMode.ONLINE)


def _reads(ws: Workspace, cfg: IngestConfig) -> dict:
    """Every feature of every view through the Feast SDK, plus the registry's materialized intervals."""
    store = open_store(ws, cfg.feature_store)
    views = {v.name: v for v in store.list_feature_views()}
    refs = {
        entity: [
            f"{name}:{f.name}" for name, v in views.items() if v.entities == [entity] for f in v.features
        ]
        for entity in ("user", "ad")
    }
    return {
        "users": store.get_online_features(features=refs["user"], entity_rows=USER_ROWS).to_dict(),
        "ads": store.get_online_features(features=refs["ad"], entity_rows=AD_ROWS).to_dict(),
        "intervals": {
            name: [(i[0].isoformat(), i[1].isoformat()) for i in v.materialization_intervals]
            for name, v in views.items()
        },
    }


def _sqlite_rows(ws: Workspace) -> dict[str, list]:
    with sqlite3.connect(ws.feature_repo / "online_store.db") as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {
            t: conn.execute(f'SELECT * FROM "{t}" ORDER BY entity_key, feature_name').fetchall()
            for t in tables
        }


def _both(tmp_path, store_cfg) -> dict[str, tuple[Workspace, IngestConfig]]:
    out = {}
    for writer in ("fast", "feast"):
        cfg = IngestConfig(feature_store=store_cfg(writer), online_writer=writer)
        out[writer] = (Workspace(tmp_path / writer), cfg)
        _publish(*out[writer])
    return out


@pytest.mark.integration  # ~20 s: six publications, half of them through Feast's slow path
def test_sqlite_fast_writer_equals_feast(tmp_path):
    runs = _both(tmp_path, lambda writer: FeatureStoreConfig())
    fast, feast = (_reads(*runs[w]) for w in ("fast", "feast"))
    assert fast == feast
    assert fast["users"]["recent_surfaces"][0] and fast["users"]["user_embedding"][0] == [0.5, -1.25]
    assert fast["intervals"]["ad_stats"]  # the registry knows what was materialized
    rows = {w: _sqlite_rows(runs[w][0]) for w in runs}
    assert rows["fast"] == rows["feast"]  # byte for byte: values, value_text, timestamps
    assert sum(len(r) for r in rows["fast"].values()) > 50


@pytest.mark.integration
def test_redis_fast_writer_equals_feast(tmp_path, redis_url):  # noqa: F811
    import redis

    host, port = redis_url.split(":")
    projects = {"fast": "gemflow_fast", "feast": "gemflow_feast"}  # one server, keys end with the project
    runs = _both(
        tmp_path,
        lambda writer: FeatureStoreConfig(
            project=projects[writer], online_store="redis", redis_connection=redis_url
        ),
    )
    assert _reads(*runs["fast"]) == _reads(*runs["feast"])
    client = redis.Redis(host=host, port=int(port))
    dumps = {}
    for writer, project in projects.items():
        suffix = project.encode()
        keys = [k for k in client.scan_iter() if k.endswith(suffix)]
        dumps[writer] = {k[: -len(suffix)]: client.hgetall(k) for k in keys}
    assert dumps["fast"] == dumps["feast"] and len(dumps["fast"]) == len(USERS) + len(ADS)


@pytest.mark.integration
def test_a_moved_feast_internal_falls_back_to_feast_with_one_warning(
    tmp_path,
    redis_url,  # noqa: F811
    monkeypatch,
    caplog,
):
    """A Feast upgrade that drops a private helper the fast path imports (``helpers._mmh3``; Feast's own Redis
    store keeps the reference it imported) costs speed, not the ingestion: every view is written by Feast, the
    values are identical, and one warning says why."""
    import feast.infra.online_stores.helpers
    import feast.infra.online_stores.redis  # noqa: F401  (Feast's store binds _mmh3 before it disappears)

    monkeypatch.delattr(feast.infra.online_stores.helpers, "_mmh3")
    monkeypatch.setattr(online_writes, "_warned", set())
    projects = {"fast": "gemflow_moved", "feast": "gemflow_reference"}
    with caplog.at_level("INFO", logger=online_writes.__name__):
        runs = _both(
            tmp_path,
            lambda writer: FeatureStoreConfig(
                project=projects[writer], online_store="redis", redis_connection=redis_url
            ),
        )
    assert _reads(*runs["fast"]) == _reads(*runs["feast"])
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "ImportError" in warnings[0] and "_mmh3" in warnings[0], warnings
    through_feast = [r.getMessage() for r in caplog.records if "through Feast (ImportError" in r.getMessage()]
    assert any(m.startswith("materialize ") for m in through_feast)
    assert any(m.startswith("push to user_recent_events") for m in through_feast)


def test_push_refuses_rows_without_the_views_columns(workspace):
    store = open_store(workspace, apply=True)
    table = pa.table({"user_id": [1], EVENT_TS: pa.array([0], pa.timestamp("us", tz="UTC"))})
    with pytest.raises(ValueError, match=r"lack column\(s\) \['recent_ad_ids'"):
        online_writes.push(store, "user_recent_events_push", table)
    with pytest.raises(ValueError, match="no feature view reads push source 'nope'"):
        online_writes.push(store, "nope", table)
