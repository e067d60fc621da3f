"""The training set's engine step on Spark: the accepted-events read (``features.spark.offline_read``), the per-user
histories, the examples (``features.spark.examples``) and the vocabulary counts, with the two big files written
by the executors.

Each produces what the embedded engine's function of the same job produces (``features.stats.read_events``,
``features.histories.build_histories``, ``features.training_sets.examples_frame`` and ``features.splits``,
``Vocabulary.build``'s counts), and ``features.training_sets`` shares the rest (items, the manifest), so the files come out value-identical:

- histories: ``collect_list`` of (ts_us, event_id, fields) per user, sorted as structs, so (ts, event_id) order;
- vocabulary: ``groupBy(id).count()`` over the training period.

``sequences.parquet`` and ``examples.parquet`` are sorted and written by the executors as part files, then
concatenated row group by row group (``features.spark.parquet_out``): the driver holds one row group, the per-id
counts and a few aggregates, never the event log or a table of it; ``ranker.parquet`` (``join_features``) is
joined point in time and written the same way (``features.spark.point_in_time``).
"""

from __future__ import annotations

import datetime as dt
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from features.histories import SEQUENCES_SCHEMA
from features.schema import HISTORY_FIELDS
from features.spark import examples as spark_examples
from features.spark.offline_read import read_events
from features.spark.parquet_out import merge_parts, write_parquet
from features.training_sets import EXAMPLE_PARTS_SCHEMA, EXAMPLE_SCHEMA, SPLITS
from features.vocabulary import ID_FIELDS
from gemflow.workspace import Workspace

SCRATCH = ".spark-scratch"  # under the workspace: the executors' part files before they are merged


def refuse_unknown_ads(events: DataFrame, count: int) -> None:
    """``count`` accepted events (> 0) whose ad is missing from their day's ads snapshot: say which."""
    sample = [
        r.ad_id for r in events.where(F.col("advertiser_id").isNull()).select("ad_id").limit(5).collect()
    ]
    raise ValueError(
        f"{count} accepted event(s) reference ads missing from their day's ads snapshot, e.g. ad_id {sample}"
    )


def write_histories(events: DataFrame, path: Path, scratch: Path) -> None:
    """``sequences.parquet`` (``Histories.to_arrow``'s rows: every user's events in (ts, event_id) order, one row
    per user in ``user_id`` order), written by the executors and merged into one file."""
    fields = [f for f in HISTORY_FIELDS if f != "ts"]
    per_user = events.groupBy("user_id").agg(
        F.sort_array(F.collect_list(F.struct("ts_us", "event_id", *fields, "ts_s"))).alias("h")
    )
    columns = [F.col(f"h.{name}").alias(name) for name in fields] + [F.col("h.ts_s").alias("ts")]
    write_file(per_user.select("user_id", *columns).orderBy("user_id"), path, scratch, SEQUENCES_SCHEMA)


def write_examples(events: DataFrame, start: dt.date, end: dt.date, cfg, path: Path, scratch: Path):
    """``examples.parquet``, assembled, split, sorted and written by the executors. Returns (users, the folder of
    the example part files: ``EXAMPLE_SCHEMA`` + ``event_timestamp``; the caller removes it)."""
    users, user_count = spark_examples.user_rows(events)
    rows = spark_examples.examples(events, users, start, end, cfg).drop("ts_us")
    parts = scratch / f"examples-{uuid.uuid4().hex}"
    write_parquet(rows, parts, EXAMPLE_PARTS_SCHEMA)
    merge_parts(parts, path, list(EXAMPLE_SCHEMA.names))
    return user_count, parts


def example_counts(spark: SparkSession, parts: Path) -> dict[str, int]:
    """The manifest's example counts (``features.training_sets.example_counts``) from the example part files."""
    examples = spark.read.parquet(str(parts))
    row = examples.agg(
        F.count(F.lit(1)).alias("examples"),
        *[F.count(F.when(F.col("split") == s, 1)).alias(f"examples_{s}") for s in SPLITS],
        F.coalesce(F.sum("click"), F.lit(0)).alias("clicks"),
        F.coalesce(F.sum("conversion"), F.lit(0)).alias("conversions"),
    ).first()
    return {k: int(v) for k, v in row.asDict().items()}


def write_file(frame: DataFrame, path: Path, scratch: Path, schema: pa.Schema) -> None:
    folder = scratch / f"parts-{uuid.uuid4().hex}"
    try:
        write_parquet(frame, folder, schema)
        merge_parts(folder, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class IdCounts:
    ids: np.ndarray  # ascending
    counts: np.ndarray


def period_counts(
    events: DataFrame, *, before_day: int | None, held_out: DataFrame | None
) -> dict[str, IdCounts]:
    """Per ``ID_FIELDS`` id: its events in the training period (``features.training_sets.training_period``):
    days before ``before_day`` (split "time") or every event but the ``held_out`` examples (``example_id``)."""
    if before_day is not None:
        period = events.where(F.col("day") < before_day)
    else:
        period = events.join(held_out.select(F.col("example_id").alias("event_id")), "event_id", "left_anti")
    out = {}
    for name in ID_FIELDS:
        table = period.groupBy(name).count().toArrow()
        ids = table.column(name).to_numpy().astype(np.int64)
        order = np.argsort(ids, kind="stable")
        out[name] = IdCounts(ids[order], table.column("count").to_numpy().astype(np.int64)[order])
    return out


def write_training_files(ws: Workspace, days: list[dt.date], start: dt.date, end: dt.date, cfg, out: Path):
    """``build_training_set``'s engine step on Spark: ``sequences``, ``examples`` (and with ``join_features``
    ``ranker``) parquet under ``out`` and what the manifest needs (``features.training_sets.EngineOutput``),
    equal to the local engine's for the same offline store."""
    from features.spark.point_in_time import write_ranker_file
    from features.spark.session import spark_session
    from features.training_sets import EngineOutput, first_held_out_day
    from features.vocabulary import Vocabulary

    spark = spark_session(cfg.spark)
    scratch = ws.root / SCRATCH
    events = read_events(spark, ws, days).persist()
    parts = None
    try:
        summary = events.agg(
            F.count(F.lit(1)).alias("events"),
            F.count(F.when(F.col("advertiser_id").isNull(), 1)).alias("unknown_ads"),
            F.max("advertiser_id").alias("advertiser_id"),
            F.max("category_id").alias("category_id"),
        ).first()
        if summary.unknown_ads:
            refuse_unknown_ads(events, summary.unknown_ads)
        write_histories(events, out / "sequences.parquet", scratch)
        users, parts = write_examples(events, start, end, cfg, out / "examples.parquet", scratch)
        time_split = cfg.split == "time"
        held_out = None if time_split else spark.read.parquet(str(parts)).where(F.col("split") != "train")
        counts = period_counts(
            events, before_day=first_held_out_day(end, cfg) if time_split else None, held_out=held_out
        )
        max_ids = {k: -1 if summary[k] is None else int(summary[k]) for k in ("advertiser_id", "category_id")}
        refs = []
        if cfg.join_features:
            refs, country = write_ranker_file(spark, ws, parts, cfg, out / "ranker.parquet", scratch)
            if country is not None:
                max_ids["user_country"] = country
        result = EngineOutput(
            vocabularies={
                name: Vocabulary.from_counts(name, c.ids, c.counts, cfg.vocabulary)
                for name, c in counts.items()
            },
            counts={"users": users, "events": summary.events, **example_counts(spark, parts)},
            max_ids=max_ids,
            feature_refs=refs,
        )
    finally:
        events.unpersist()
        if parts is not None:
            shutil.rmtree(parts, ignore_errors=True)
    return result
