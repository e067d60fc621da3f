"""The ranker set's point-in-time feature join on Spark: ``features.training_sets.join_features`` (Feast's
``get_historical_features`` on its local offline store) as Spark SQL over the same offline partitions, so a
ranker set never passes through the driver.

Feast's rule (``feast.infra.offline_stores.ibis.point_in_time_join`` with ``filter_by_created_timestamp``), per
feature view and example: among the view's rows with the example's entity key whose ``event_timestamp`` and
``created_ts`` are both at or before the example's ``event_timestamp`` and, when the view has a ttl, whose
``event_timestamp + ttl`` is at or after it, the newest by (``event_timestamp``, ``created_ts``); none gives nulls.
The view's rows are matched once per distinct (key, example time), as Feast matches its entity rows.
"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from features.feature_repo.offline import partition_files
from features.feature_repo.tables import CREATED_TS, EVENT_TS
from gemflow.workspace import Workspace

ROW_TS, ROW_CREATED = "_row_ts", "_row_created"  # a view row's event_timestamp and created_ts


def _view_rows(spark: SparkSession, ws: Workspace, view: str, key: str, names: list[str]) -> DataFrame | None:
    folders = [str(p) for p in sorted(ws.offline(view).glob("date=*")) if partition_files(p)]
    if not folders:
        return None
    rows = spark.read.option("basePath", str(ws.offline(view))).parquet(*folders)
    return rows.select(key, *names, F.col(EVENT_TS).alias(ROW_TS), F.col(CREATED_TS).alias(ROW_CREATED))


def as_of(examples: DataFrame, rows: DataFrame, key: str, names: list[str], ttl_seconds: int) -> DataFrame:
    """(key, ``EVENT_TS``, ``names``): each distinct (key, example time)'s newest view row as of that time."""
    wanted = examples.select(key, EVENT_TS).distinct()
    seen = (
        (rows[key] == wanted[key])
        & (rows[ROW_TS] <= wanted[EVENT_TS])
        & (rows[ROW_CREATED] <= wanted[EVENT_TS])
    )
    if ttl_seconds:
        seen &= rows[ROW_TS] + F.make_dt_interval(secs=F.lit(ttl_seconds)) >= wanted[EVENT_TS]
    matched = wanted.join(rows, seen).select(wanted[key], wanted[EVENT_TS], *names, ROW_TS, ROW_CREATED)
    newest = Window.partitionBy(key, EVENT_TS).orderBy(F.col(ROW_TS).desc(), F.col(ROW_CREATED).desc())
    ranked = matched.withColumn("_newest", F.row_number().over(newest))
    return ranked.where(F.col("_newest") == 1).select(key, EVENT_TS, *names)


def write_ranker_file(spark: SparkSession, ws: Workspace, parts: Path, cfg, path: Path, scratch: Path):
    """``ranker.parquet`` from the example part files (``EXAMPLE_PARTS_SCHEMA``), written by the executors.
    Returns (the feature refs, the largest ``user_country``: -1 when none, None when not joined)."""
    from features.spark.training_sets import write_file
    from features.training_sets import EXAMPLE_PARTS_SCHEMA, feature_store_refs, ranker_schema

    store, refs = feature_store_refs(ws, cfg)
    examples = spark.read.parquet(str(parts))
    joined = examples
    by_view: dict[str, list[str]] = {}
    for ref in refs:
        view, name = ref.split(":")
        by_view.setdefault(view, []).append(name)
    for view_name, names in by_view.items():
        view = store.get_feature_view(view_name)
        (key,) = view.join_keys
        rows = _view_rows(spark, ws, view_name, key, names)
        if rows is None:
            joined = joined.select("*", *[F.lit(None).alias(n) for n in names])
            continue
        ttl = int(view.ttl.total_seconds()) if view.ttl else 0
        joined = joined.join(as_of(examples, rows, key, names, ttl), [key, EVENT_TS], "left")
    schema = ranker_schema(EXAMPLE_PARTS_SCHEMA, refs)
    for name in schema.names:
        if name not in joined.columns:  # the embedding columns when no embedding was refreshed yet
            joined = joined.select("*", F.lit(None).alias(name))
    # the examples' order: event_timestamp holds ts_us exactly
    write_file(joined.orderBy(EVENT_TS, "example_id"), path, scratch, schema)
    if "user_country" not in schema.names:
        return refs, None
    country = spark.read.parquet(str(path)).agg(F.max("user_country")).first()[0]  # one column of the file
    return refs, -1 if country is None else int(country)
