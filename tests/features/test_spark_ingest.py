"""Engine equality for ingestion: the same raw partitions through ``engine: local`` and ``engine: spark``
(``local[2]``) give the same quarantine (rows, values, reasons), the same offline store (accepted partitions and
derived feature tables) and the same online store, on the demo generator's log with every row defect injected
and on days of MovieLens-100K.

Spark needs Java: like the Redis tests, these fail (not skip) where it is missing (``make java``)."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pandas as pd
import pytest
import yaml

from features.feature_repo.offline import partition_days, read_partition
from features.ingest import IngestConfig, ingest
from features.sources.defects import ROW_DEFECTS
from features.sources.movielens import import_movielens
from features.sources.synthetic import SyntheticConfig, generate
from features.spark.session import SparkConfig
from features.store import open_store
from features.validation import ValidationGateError
from gemflow.workspace import Workspace

pytestmark = pytest.mark.integration
SPARK = SparkConfig(master="local[2]", shuffle_partitions=4)
NOW = "2026-02-01T00:00:00+00:00"
ENGINES = ("local", "spark")
USER_VIEWS = ["user_profile", "user_recent_events"]
AD_VIEWS = ["ad_attributes", "ad_stats"]


def _config(engine: str, **gate) -> IngestConfig:
    return IngestConfig(gate={"data_docs": False, **gate}, now=NOW, engine=engine, spark=SPARK)


def _normalized(frame: pd.DataFrame) -> pd.DataFrame:
    """Values as the same Python objects whatever the engine's dtype (an int column with nulls reads as float
    in pandas, as a nullable long in Spark)."""
    out = frame.astype(object).where(frame.notna(), None)
    for column in out.columns:
        out[column] = out[column].map(lambda v: float(v) if isinstance(v, int | float | np.number) else v)
    return out.reset_index(drop=True)


def _quarantine(ws: Workspace, table: str, day: dt.date) -> pd.DataFrame:
    folder = ws.quarantine(table, day)
    return _normalized(read_partition(folder).to_pandas()) if folder.exists() else pd.DataFrame()


def _assert_same_stores(local: Workspace, spark: Workspace, days: list[dt.date]) -> None:
    tables = sorted(p.name for p in local.offline("events").parent.iterdir())
    assert tables == sorted(p.name for p in spark.offline("events").parent.iterdir())
    for day in days:
        for table in ("users", "ads", "events"):
            left, right = _quarantine(local, table, day), _quarantine(spark, table, day)
            pd.testing.assert_frame_equal(left, right, check_dtype=False, obj=f"quarantine {table} {day}")
        for table in tables:
            if not partition_days(local, "offline", table):
                continue
            left, right = read_partition(local.offline(table, day)), read_partition(spark.offline(table, day))
            assert left.schema.names == right.schema.names, table
            assert [f.type for f in left.schema] == [f.type for f in right.schema], table
            assert left.to_pylist() == right.to_pylist(), f"offline {table} {day} differs between the engines"
    assert _online(local) == _online(spark)


def _online(ws: Workspace) -> dict:
    """Every online value of every user and ad the offline store knows."""
    store = open_store(ws)
    users = sorted(set(read_partition(ws.offline("users", partition_days(ws, "offline", "users")[-1]))
                       .column("user_id").to_pylist()))  # fmt: skip
    ads = sorted(set(read_partition(ws.offline("ads", partition_days(ws, "offline", "ads")[-1]))
                     .column("ad_id").to_pylist()))  # fmt: skip
    out = {}
    for views, key, ids in ((USER_VIEWS, "user_id", users), (AD_VIEWS, "ad_id", ads)):
        refs = [
            f"{v.name}:{f.name}" for v in store.list_feature_views() if v.name in views for f in v.features
        ]
        out[key] = store.get_online_features(features=refs, entity_rows=[{key: i} for i in ids]).to_dict()
    assert any(v is not None for v in out["user_id"]["recent_ad_ids"])
    return out


def _reasons(ws: Workspace, day: dt.date) -> dict:
    return json.loads((ws.reports(day) / "ingest_summary.json").read_text())["tables"]


def test_synthetic_ingestion_with_every_defect_is_identical_on_both_engines(tmp_path):
    inject = {name: 0.01 for name in ROW_DEFECTS}
    cfg = SyntheticConfig(num_users=200, num_ads=200, num_advertisers=20, num_categories=10, days=2)
    spaces = {engine: Workspace(tmp_path / engine) for engine in ENGINES}
    for engine, ws in spaces.items():
        generate(cfg, ws, inject=inject, progress=False)
        for day in partition_days(ws, "raw", "events"):
            ingest(ws, day, _config(engine, max_failure_rate=0.2))
    days = partition_days(spaces["local"], "raw", "events")
    for day in days:
        local, spark = _reasons(spaces["local"], day), _reasons(spaces["spark"], day)
        assert local == spark
        assert len(local["events"]["reasons"]) >= len(ROW_DEFECTS)  # every defect class was caught
    _assert_same_stores(spaces["local"], spaces["spark"], days)


def test_a_rejected_partition_quarantines_the_same_rows_on_both_engines(tmp_path):
    cfg = SyntheticConfig(num_users=100, num_ads=100, num_advertisers=10, num_categories=5, days=1)
    quarantines = {}
    for engine in ENGINES:
        ws = Workspace(tmp_path / engine)
        generate(cfg, ws, inject={"bad_enum": 0.1, "null_field": 0.05}, progress=False)
        (day,) = partition_days(ws, "raw", "events")
        with pytest.raises(ValidationGateError, match="exceeds max_failure_rate"):
            ingest(ws, day, _config(engine))
        assert not partition_days(ws, "offline", "events")  # nothing accepted is published
        quarantines[engine] = _quarantine(ws, "events", day)
    assert len(quarantines["local"]) > 0
    pd.testing.assert_frame_equal(quarantines["local"], quarantines["spark"], check_dtype=False)


def test_movielens_days_ingest_identically_on_both_engines(movielens_dir, tmp_path, repo_root):
    gate = yaml.safe_load((repo_root / "configs" / "movielens-ingest.yaml").read_text())["gate"]
    spaces = {engine: Workspace(tmp_path / engine) for engine in ENGINES}
    for ws in spaces.values():
        import_movielens(ws, movielens_dir, progress=False)
    # The three busiest days (GX on Spark costs ~15 s per table and day; 213 days would take an hour).
    raw = spaces["local"].raw("events")
    days = sorted(
        partition_days(spaces["local"], "raw", "events"),
        key=lambda d: -sum(p.stat().st_size for p in (raw / f"date={d}").glob("*.parquet")),
    )[:3]
    for engine, ws in spaces.items():
        for day in sorted(days):
            ingest(ws, day, _config(engine, **gate))
    for day in days:
        assert _reasons(spaces["local"], day) == _reasons(spaces["spark"], day)
    _assert_same_stores(spaces["local"], spaces["spark"], sorted(days))
