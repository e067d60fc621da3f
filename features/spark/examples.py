"""The training set's example rows on Spark, assembled and split by the executors: the rows
``features.training_sets.examples_frame`` and ``features.splits`` give on the embedded engine, without a row
passing through the driver.

- ``user_row`` is a user's row in ``sequences.parquet`` (one row per user, ``user_id`` order): the global index of
  the sorted distinct users, from ``monotonically_increasing_id`` (partition id << 33 | row in partition) and the
  per-partition counts, the only thing collected (one number per partition);
- ``cut`` is ``rank() - 1`` over the user's events by whole seconds: the events strictly before the example's
  second (ties share their first row's rank, exactly ``searchsorted(..., side="left")``);
- ``split``: by day (``time``) or, for ``leave-one-out``, per user from the positives ranked latest first (the
  embedded engine's stable sort by (user, ts, cut) keeps (ts_us, example_id) order within a second).
"""

from __future__ import annotations

import datetime as dt

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from features.feature_repo.tables import EVENT_TS
from features.schema import ACTIONS

IMPRESSION = ACTIONS.index("impression")
_ROW_BITS = 33  # monotonically_increasing_id: the row within its partition in the low 33 bits
ORDER = ("ts_us", "example_id")  # the examples' order on both engines


def user_rows(events: DataFrame) -> tuple[DataFrame, int]:
    """(user_id, user_row) for every user with an event, and the number of users."""
    ids = events.select("user_id").distinct().orderBy("user_id")
    tagged = ids.withColumn("mid", F.monotonically_increasing_id()).persist()  # the ids must not be redrawn
    part = F.shiftright("mid", _ROW_BITS)
    counts = dict(tagged.groupBy(part.alias("p")).count().collect())
    offsets, total = {}, 0
    for p in sorted(counts):
        offsets[p], total = total, total + counts[p]
    first_row = F.element_at(
        F.create_map(*[F.lit(v) for p, o in offsets.items() for v in (p, o)]) if offsets else F.create_map(),
        part,
    )
    rows = tagged.select("user_id", (first_row + (F.col("mid") % (1 << _ROW_BITS))).alias("user_row"))
    return rows, total


def _split_by_day(end: dt.date, valid_days: int, test_days: int) -> Column:
    test_from = end.toordinal() - test_days + 1
    valid_from = test_from - valid_days
    day = F.col("day")
    return F.when(day >= test_from, "test").when(day >= valid_from, "valid").otherwise("train")


def _split_leave_one_out(examples: DataFrame) -> DataFrame:
    """``features.splits.leave_one_out_split`` on Spark: each user's last positive -> test, second-last -> valid,
    rows before the valid positive -> train, non-positives between valid and test -> valid, else ""."""
    latest_first = Window.partitionBy("user_id").orderBy(*[F.col(c).desc() for c in ORDER])
    positives = examples.where(F.col("click") > 0).select(
        "example_id",
        "user_id",
        "ts",
        (F.row_number().over(latest_first) - 1).alias("ranked"),
        F.count(F.lit(1)).over(Window.partitionBy("user_id")).alias("positives"),
    )
    eligible = positives.where(F.col("positives") >= 3)
    bounds = eligible.groupBy("user_id").agg(
        F.max(F.when(F.col("ranked") == 1, F.col("ts"))).alias("valid_ts"),
        F.max(F.when(F.col("ranked") == 0, F.col("ts"))).alias("test_ts"),
    )
    marked = eligible.where(F.col("ranked") <= 1).select(
        "example_id", F.when(F.col("ranked") == 0, "test").otherwise("valid").alias("marked")
    )
    out = examples.join(bounds, "user_id", "left").join(marked, "example_id", "left")
    ts = F.col("ts")
    split = (
        F.when(F.col("marked").isNotNull(), F.col("marked"))
        .when(ts < F.col("valid_ts"), "train")
        .when((ts > F.col("valid_ts")) & (ts < F.col("test_ts")) & (F.col("click") <= 0), "valid")
        .otherwise("")
    )
    return out.withColumn("split", split).drop("valid_ts", "test_ts", "marked")


def examples(events: DataFrame, users: DataFrame, start: dt.date, end: dt.date, cfg) -> DataFrame:
    """The impressions of [start, end] as example rows (``EXAMPLE_COLUMNS`` + ``event_timestamp``), in
    (ts, example_id) order; ``events`` as ``features.spark.offline_read.read_events`` gives them."""
    by_second = Window.partitionBy("user_id").orderBy("ts_s")
    ranked = events.withColumn("cut", (F.rank().over(by_second) - 1).cast("long"))
    imp = ranked.where(
        (F.col("day") >= start.toordinal())
        & (F.col("day") <= end.toordinal())
        & (F.col("action") == IMPRESSION)
    ).join(users, "user_id")
    rows = imp.select(
        F.col("event_id").alias("example_id"),
        "user_id",
        "user_row",
        "cut",
        "ad_id",
        "advertiser_id",
        "category_id",
        F.col("quality").cast("float").alias("quality"),
        "surface",
        F.col("ts_s").alias("ts"),
        F.col("click").cast("byte").alias("click"),
        F.col("conversion").cast("byte").alias("conversion"),
        "day",
        F.col("ts").alias(EVENT_TS),
        "ts_us",
    )
    if cfg.split == "leave-one-out":
        rows = _split_leave_one_out(rows)
    else:
        rows = rows.withColumn("split", _split_by_day(end, cfg.valid_days, cfg.test_days))
    return rows.orderBy(*ORDER).drop("day")
