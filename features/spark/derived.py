"""Ingestion step 4 on Spark: a day's derived feature tables (``features.stats``: ad stats, recent events),
computed and written by the executors, value-identical to the local engine's.

- ``ad_stats``: one ``groupBy(ad_id)`` over the look-back window's impressions, a conditional count / sum per
  window, joined onto the day's ads snapshot (an ad with no impressions has zero counts);
- ``user_recent_events``: the users with an event on the day, each one's newest ``n`` events of the window by
  ``(ts_us, event_id)`` (an ``event_id`` seen on two days counts once, the earliest: ``recent_events.merge``'s
  rule), as one row of lists (``recent_events.view_rows``) stamped at the day's end.
"""

from __future__ import annotations

import datetime as dt

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from features.feature_repo.offline import day_end
from features.feature_repo.tables import (
    AD_STATS,
    CREATED_TS,
    EVENT_TS,
    STATS_WINDOWS,
    USER_RECENT_EVENTS,
    stats_column,
)
from features.recent_events import LIST_COLUMNS, SECOND_US
from features.schema import ACTION_ID
from features.spark.offline_read import read_days, read_events
from features.spark.parquet_out import write_parquet
from gemflow.workspace import Workspace


def _day_end(day: dt.date) -> Column:
    return F.lit(day_end(day).to_pydatetime()).cast("timestamp")


def ad_stats(events: DataFrame, ads: DataFrame, day: dt.date) -> DataFrame:
    """``features.stats.ad_stats_table`` on Spark (``events``: ``read_events`` of the window ending at ``day``)."""
    impressions = events.where(F.col("action") == ACTION_ID["impression"])
    age = F.lit(day.toordinal()) - F.col("day")
    sums = []
    for days in STATS_WINDOWS:
        inside = (age >= 0) & (age < days)
        sums += [
            F.count(F.when(inside, 1)).alias(stats_column("impressions", days)),
            F.sum(F.when(inside, F.col("click").cast("long"))).alias(stats_column("clicks", days)),
            F.sum(F.when(inside, F.col("conversion").cast("long"))).alias(stats_column("conversions", days)),
        ]
    per_ad = impressions.groupBy("ad_id").agg(*sums)
    ids = ads.select("ad_id").union(impressions.select("ad_id")).distinct()
    counts = ids.join(per_ad, "ad_id", "left")
    columns = [F.col("ad_id")]
    for days in STATS_WINDOWS:
        n_imp, n_click, n_conv = (
            F.coalesce(F.col(stats_column(kind, days)), F.lit(0)).cast("long")
            for kind in ("impressions", "clicks", "conversions")
        )
        columns += [
            n_imp.alias(stats_column("impressions", days)),
            n_click.alias(stats_column("clicks", days)),
            n_conv.alias(stats_column("conversions", days)),
            (n_click / F.greatest(n_imp, F.lit(1))).cast("float").alias(stats_column("ctr", days)),
            (n_conv / F.greatest(n_click, F.lit(1))).cast("float").alias(stats_column("cvr", days)),
        ]
    stamp = _day_end(day)
    return counts.select(*columns, stamp.alias(EVENT_TS), stamp.alias(CREATED_TS)).orderBy("ad_id")


def recent_events(events: DataFrame, day: dt.date, n: int) -> DataFrame:
    """``features.stats.recent_events_table`` on Spark."""
    if n <= 0:
        raise ValueError(f"recent events: n must be positive, got {n}")
    active = events.where(F.col("day") == day.toordinal()).select("user_id").distinct()
    mine = events.join(active, "user_id")
    first_seen = Window.partitionBy("event_id").orderBy("day")
    once = mine.withColumn("seen", F.row_number().over(first_seen)).where(F.col("seen") == 1)
    newest_first = Window.partitionBy("user_id").orderBy(F.col("ts_us").desc(), F.col("event_id").desc())
    kept = once.withColumn("newest", F.row_number().over(newest_first)).where(F.col("newest") <= n)
    fields = sorted(set(LIST_COLUMNS.values()) - {"ts_us", "event_id"})
    lists = kept.groupBy("user_id").agg(
        F.sort_array(F.collect_list(F.struct("ts_us", "event_id", *fields))).alias("e")
    )
    as_of_us = F.lit(int(day_end(day).value // 1000))
    columns = {name: F.col(f"e.{source}") for name, source in LIST_COLUMNS.items()}
    columns["recent_ts"] = F.transform(
        "e", lambda x: ((x["ts_us"] - F.pmod(x["ts_us"], F.lit(SECOND_US))) / SECOND_US).cast("long")
    )
    columns["recent_time_gaps"] = F.transform("e", lambda x: ((as_of_us - x["ts_us"]) / 1e6).cast("float"))
    stamp = _day_end(day)
    columns[EVENT_TS] = columns[CREATED_TS] = stamp
    return lists.select(
        *[
            F.col("user_id") if name == "user_id" else columns[name].alias(name)
            for name in USER_RECENT_EVENTS.names
        ]
    ).orderBy("user_id")


def write_derived_day(spark: SparkSession, ws: Workspace, day: dt.date, cfg) -> dict[str, int]:
    """Ad stats and recent events as of ``day``'s end, written to the offline store; returns rows per table."""
    window = [day - dt.timedelta(days=k) for k in range(cfg.lookback_days - 1, -1, -1)]
    events = read_events(spark, ws, window).persist()
    try:
        ads = read_days(spark, ws, "ads", [day], ["ad_id"])
        return {
            "ad_stats": write_parquet(ad_stats(events, ads, day), ws.offline("ad_stats", day), AD_STATS),
            "user_recent_events": write_parquet(
                recent_events(events, day, cfg.recent_events),
                ws.offline("user_recent_events", day),
                USER_RECENT_EVENTS,
            ),
        }
    finally:
        events.unpersist()
