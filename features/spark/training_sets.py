"""The training set's distributed stages on Spark: the accepted-events read (events + their day's ads), the
per-user histories, the leak-free cut of every example and the vocabulary counts.

Each produces what the embedded engine's function of the same job produces (``features.stats.read_events``,
``features.histories.build_histories`` / ``cut_points``, ``Vocabulary.build``'s counts), so
``features.training_sets`` assembles, splits and writes both engines' results with one code path:

- histories: ``collect_list`` of (ts_us, event_id, fields) per user, sorted as structs, so (ts, event_id) order;
- cut: ``rank() - 1`` over the user's events ordered by whole seconds = how many of them fall strictly before
  the example's second (ties share the rank of their first row, exactly ``searchsorted(..., side="left")``);
- vocabulary: ``groupBy(id).count()`` over the training period.

What comes back to the driver is what the training set files hold (one row per user, one per impression), through
part files (``features.spark.parquet_out.collect_arrow``), and the per-id counts, never the event log itself.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from features.feature_repo.offline import partition_files
from features.histories import SECOND_US, Histories
from features.schema import ACTIONS, HISTORY_FIELDS, SURFACES
from features.spark.parquet_out import collect_arrow
from features.vocabulary import ID_FIELDS
from gemflow.workspace import Workspace

IMPRESSION = ACTIONS.index("impression")
SCRATCH = ".spark-scratch"  # under the workspace: executors write what the driver reads back (collect_arrow)
EPOCH = dt.date(1970, 1, 1)
EPOCH_ORDINAL = EPOCH.toordinal()  # day ordinal = days since 1970-01-01 + this (py4j cannot send year 1)


def _read_days(spark: SparkSession, ws: Workspace, table: str, days: list[dt.date], columns: list[str]):
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
    events = _read_days(
        spark, ws, "events", days,
        ["event_id", "user_id", "ad_id", "action", "surface", "ts", "click", "conversion"],
    )  # fmt: skip
    ads = _read_days(spark, ws, "ads", days, ["ad_id", "advertiser_id", "category_id", "quality"])
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


def check_known_ads(events: DataFrame) -> None:
    unknown = events.where(F.col("advertiser_id").isNull())
    count = unknown.count()
    if count:
        sample = [r.ad_id for r in unknown.select("ad_id").limit(5).collect()]
        raise ValueError(
            f"{count} accepted event(s) reference ads missing from their day's ads snapshot, e.g. ad_id {sample}"
        )


def build_histories(events: DataFrame, scratch: Path) -> Histories:
    """Every user's events in (ts, event_id) order, one row per user in ``user_id`` order (``scratch``: see
    ``collect_arrow``)."""
    fields = [f for f in HISTORY_FIELDS if f != "ts"]
    per_user = events.groupBy("user_id").agg(
        F.sort_array(F.collect_list(F.struct("ts_us", "event_id", *fields, "ts_s"))).alias("h")
    )
    columns = [F.col(f"h.{name}").alias(name) for name in (*fields, "ts_s")]
    table = collect_arrow(per_user.select("user_id", *columns).orderBy("user_id"), scratch)
    if table.num_rows == 0:
        empty = np.zeros(0, np.int64)
        return Histories(empty, np.zeros(1, np.int64), {name: empty for name in HISTORY_FIELDS})
    lists = {name: table.column(name).combine_chunks() for name in (*fields, "ts_s")}
    offsets = lists["ts_s"].offsets.to_numpy().astype(np.int64)
    values = {name: pc.list_flatten(lists[name]).to_numpy().astype(np.int64) for name in fields}
    values["ts"] = pc.list_flatten(lists["ts_s"]).to_numpy().astype(np.int64)
    user_ids = table.column("user_id").to_numpy().astype(np.int64)
    return Histories(user_ids=user_ids, offsets=offsets, values=values)


def impressions_with_cut(events: DataFrame, start: dt.date, end: dt.date, scratch: Path) -> pd.DataFrame:
    """The impressions of [start, end] with ``cut``: the user's events strictly before the impression's second."""
    by_second = Window.partitionBy("user_id").orderBy("ts_s")
    ranked = events.withColumn("cut", (F.rank().over(by_second) - 1).cast("long"))
    imp = ranked.where(
        (F.col("day") >= start.toordinal())
        & (F.col("day") <= end.toordinal())
        & (F.col("action") == IMPRESSION)
    )
    # self_destruct: each column's Arrow buffers are freed as it converts (the driver holds one copy, not two)
    return collect_arrow(imp.drop("ts_s", "action"), scratch).to_pandas(split_blocks=True, self_destruct=True)


@dataclass
class IdCounts:
    ids: np.ndarray  # ascending
    counts: np.ndarray


def period_counts(
    spark: SparkSession, events: DataFrame, *, before_day: int | None, held_out: np.ndarray
) -> dict[str, IdCounts]:
    """Per ``ID_FIELDS`` id: its events in the training period (``features.training_sets.training_period``):
    days before ``before_day`` (split "time") or every event but the ``held_out`` example ids."""
    if before_day is not None:
        period = events.where(F.col("day") < before_day)
    else:
        ids = spark.createDataFrame(pa.table({"event_id": pa.array(held_out, pa.int64())}))
        period = events.join(F.broadcast(ids), on="event_id", how="left_anti")
    out = {}
    for name in ID_FIELDS:
        table = period.groupBy(name).count().toArrow()
        ids = table.column(name).to_numpy().astype(np.int64)
        order = np.argsort(ids, kind="stable")
        out[name] = IdCounts(ids[order], table.column("count").to_numpy().astype(np.int64)[order])
    return out


def histories_examples_vocabularies(ws: Workspace, days: list[dt.date], start: dt.date, end: dt.date, cfg):
    """``build_training_set``'s engine step on Spark: (histories, examples, vocabularies) equal to the local
    engine's for the same offline store."""
    from features.spark.session import spark_session
    from features.splits import leave_one_out_split
    from features.training_sets import examples_frame, first_held_out_day, held_out_ids
    from features.vocabulary import Vocabulary

    spark = spark_session(cfg.spark)
    events = read_events(spark, ws, days).persist()
    try:
        check_known_ads(events)
        scratch = ws.root / SCRATCH
        histories = build_histories(events, scratch)
        imp = impressions_with_cut(events, start, end, scratch)
        user_row = np.searchsorted(histories.user_ids, imp["user_id"].to_numpy(np.int64))
        examples = examples_frame(imp, user_row, imp["cut"].to_numpy(np.int64), end, cfg)
        if cfg.split == "leave-one-out":
            examples["split"] = leave_one_out_split(examples)
        time_split = cfg.split == "time"
        counts = period_counts(
            spark,
            events,
            before_day=first_held_out_day(end, cfg) if time_split else None,
            held_out=np.zeros(0, np.int64) if time_split else held_out_ids(examples),
        )
    finally:
        events.unpersist()
    vocabularies = {
        name: Vocabulary.from_counts(name, c.ids, c.counts, cfg.vocabulary) for name, c in counts.items()
    }
    return histories, examples, vocabularies
