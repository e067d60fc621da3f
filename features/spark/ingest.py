"""Ingestion steps 1-3 on Spark (``IngestConfig.engine: spark``): the raw read, the gate, the offline writes.

- read: every landed file of the partition (batch landing, then the live export), one file at a time as the
  local engine reads it (a file whose column arrived as text keeps it as text), each row numbered ``ROW`` by its
  place in that reading order (file offsets from the parquet footers + ``_metadata.row_index``); a live event
  identical to a batch event counts once (``features.ingestion.raw.delivered_twice``, as an anti-join);
- gate: ``features.spark.gate`` (the shared suites through GX's Spark datasource);
- write: accepted rows sorted by ``SORT_KEYS`` and quarantined rows in ``ROW`` order, both written by the
  executors with the offline store's writer and exact schema (``features.spark.parquet_out``); the day's
  profile/attribute rows from the accepted users/ads snapshots with the local engine's functions.

Step 4 (derived feature tables) runs on Spark too (``features.spark.derived``); step 5 (online publish) is
shared with the local engine and reads the offline store these writes produced, so identical offline contents
give identical online contents.
"""

from __future__ import annotations

import datetime as dt
from functools import reduce

import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from features.feature_repo.offline import partition_files, read_partition
from features.ingestion import step
from features.ingestion.offline import SORT_KEYS, write_snapshot_features
from features.ingestion.raw import TABLES, missing_partition, raw_folders
from features.schema import SCHEMAS
from features.spark.gate import ROW, validate_partition
from features.spark.parquet_out import write_parquet
from gemflow.workspace import Workspace


def _union(frames: list[DataFrame]) -> DataFrame:
    """Frames of one partition's files; a column typed differently across files becomes text in all."""
    types: dict[str, set] = {}
    for frame in frames:
        for f in frame.schema.fields:
            types.setdefault(f.name, set()).add(f.dataType.simpleString())
    mixed = {name for name, kinds in types.items() if len(kinds) > 1}
    cast = [
        frame.select(*[F.col(c).cast("string").alias(c) if c in mixed else F.col(c) for c in frame.columns])
        for frame in frames
    ]
    return reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), cast)


def read_raw(spark: SparkSession, ws: Workspace, table: str, day: dt.date) -> DataFrame:
    """The raw partition with its ``ROW`` numbers."""
    sources, offset = [], 0
    for folder in raw_folders(ws, table, day):
        frames = []
        for path in partition_files(folder):
            frame = spark.read.parquet(str(path))
            frames.append(frame.select(*frame.columns, (F.col("_metadata.row_index") + offset).alias(ROW)))
            offset += pq.ParquetFile(path).metadata.num_rows
        if frames:
            sources.append(_union(frames))
    if not sources:
        raise missing_partition(ws, table, day)
    if len(sources) == 1:
        return sources[0]
    batch, live = sources
    shared = [c for c in SCHEMAS["events"].names if c in batch.columns and c in live.columns]
    same = reduce(lambda a, b: a & b, [F.col(f"l.{c}").eqNullSafe(F.col(f"b.{c}")) for c in shared])
    fresh = live.alias("l").join(batch.alias("b"), same, "left_anti")
    return _union([batch, fresh])


def gate_and_write(ws: Workspace, day: dt.date, cfg, timings: dict) -> tuple[dict, dict, dict]:
    """Read, gate and write ``day`` on Spark; returns (raw rows per table, gate results, derived rows)."""
    from features.ingest import validate_day
    from features.spark.session import spark_session

    spark = spark_session(cfg.spark)
    with step("read raw", timings):
        raw = {table: read_raw(spark, ws, table, day).persist() for table in TABLES}
        rows = {table: frame.count() for table, frame in raw.items()}

    def validate_table(table: str, **gate) -> object:
        return validate_partition(
            spark, table, raw[table], rows=rows[table], day=day, report_dir=ws.reports(day), **gate
        )

    try:
        with step("validate", timings):
            results = validate_day(ws, day, cfg, validate_table, quarantine=write_quarantine)
        with step("write offline", timings):
            for table, result in results.items():
                ordered = result.accepted.orderBy(*SORT_KEYS[table])
                write_parquet(ordered.select(*SCHEMAS[table].names), ws.offline(table, day), SCHEMAS[table])
                write_quarantine(ws, result, day)
            snapshots = {t: read_partition(ws.offline(t, day)).to_pandas() for t in ("users", "ads")}
            derived_rows = write_snapshot_features(ws, day, snapshots["users"], snapshots["ads"])
    finally:
        for frame in raw.values():
            frame.unpersist()
    return rows, results, derived_rows


def write_quarantine(ws: Workspace, result, day: dt.date) -> None:
    """The quarantined rows as they arrived, plus ``reason``, in reading order."""
    ordered = result.quarantined.orderBy(ROW).drop(ROW)
    write_parquet(ordered, ws.quarantine(result.table, day))
