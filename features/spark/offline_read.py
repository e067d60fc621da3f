"""The accepted offline store read on Spark: ``features.feature_repo.offline.read_days`` and
``features.stats.read_events`` as DataFrames (the same columns, ids and ``day`` ordinals), for the training
sets (``features.spark.training_sets``) and the derived tables (``features.spark.derived``)."""

from __future__ import annotations

import datetime as dt

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from features.feature_repo.offline import partition_files
from features.histories import SECOND_US
from features.schema import ACTIONS, SURFACES
from gemflow.workspace import Workspace

EPOCH = dt.date(1970, 1, 1)
EPOCH_ORDINAL = EPOCH.toordinal()  # day ordinal = days since 1970-01-01 + this (py4j cannot send year 1)


def read_days(spark: SparkSession, ws: Workspace, table: str, days: list[dt.date], columns: list[str]):
    """Accepted rows of ``table`` for ``days`` plus ``day`` (the date's ordinal, as ``read_days`` gives it)."""
    folders = [str(ws.offline(table, d)) for d in days if partition_files(ws.offline(table, d))]
    if not folders:
        raise FileNotFoundError(f"no accepted {table} partitions for {days[0]}..{days[-1]}")
    frame = spark.read.option("basePath", str(ws.offline(table))).parquet(*folders)
    day = F.datediff(F.to_date(F.col("date").cast("string")), F.lit(EPOCH.isoformat()).cast("date"))
    return frame.select(*columns, (day + EPOCH_ORDINAL).cast("long").alias("day"))


def _vocab_id(column: str, vocabulary: tuple[str, ...]) -> Column:
    # array_position is 1-based (0 when absent); accepted rows always hold a known value.
    return (F.array_position(F.array(*[F.lit(v) for v in vocabulary]), F.col(column)) - 1).cast("long")


def read_events(spark: SparkSession, ws: Workspace, days: list[dt.date]) -> DataFrame:
    """``features.stats.read_events`` on Spark: accepted events joined with their day's ads snapshot, ids for
    action/surface, ``ts_us`` (µs) and ``ts_s`` (whole seconds, floored)."""
    events = read_days(
        spark, ws, "events", days,
        ["event_id", "user_id", "ad_id", "action", "surface", "ts", "click", "conversion"],
    )  # fmt: skip
    ads = read_days(spark, ws, "ads", days, ["ad_id", "advertiser_id", "category_id", "quality"])
    joined = events.join(ads, on=["day", "ad_id"], how="left")
    ts_us = F.unix_micros("ts")
    return joined.select(
        "event_id",
        "user_id",
        "ad_id",
        _vocab_id("action", ACTIONS).alias("action"),
        _vocab_id("surface", SURFACES).alias("surface"),
        "ts",
        "click",
        "conversion",
        "day",
        F.col("advertiser_id").cast("long").alias("advertiser_id"),
        F.col("category_id").cast("long").alias("category_id"),
        "quality",
        ts_us.alias("ts_us"),
        ((ts_us - F.pmod(ts_us, F.lit(SECOND_US))) / SECOND_US).cast("long").alias("ts_s"),
    )
