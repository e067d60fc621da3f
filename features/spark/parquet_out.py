"""Parquet written by Spark's executors with the offline store's writer (pyarrow, ``PARQUET_OPTIONS``, an exact
arrow schema), so a partition folder the Spark engine writes reads back as the local engine's would.

Spark's own ``DataFrame.write.parquet`` would change the types readers see (every column nullable, lists named
``element``, random file names); here each task streams its rows into ``part-<task>.parquet`` of the folder, in
the frame's order (a sorted frame gives files whose concatenation, in name order, is sorted). Nothing but a
per-file row count reaches the driver.

``merge_parts`` concatenates a folder's part files into the one file a reader expects, a row group at a time: the
driver holds one row group, never the table (``toArrow()`` would gather every row in the driver JVM's heap first:
a 50M-event training window broke an 8 GB driver there).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame

from features.feature_repo.offline import PARQUET_OPTIONS, write_partition


def write_parquet(frame: DataFrame, folder: Path, schema: pa.Schema | None = None) -> int:
    """Replace ``folder``'s parquet files with ``frame``'s rows (cast to ``schema`` when given); returns rows.

    ``folder`` must be reachable from every executor under the same path (local mode, a shared volume)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.parquet"):
        stale.unlink()
    target, options = str(folder), {k: v for k, v in PARQUET_OPTIONS.items() if k != "row_group_size"}
    row_group = PARQUET_OPTIONS["row_group_size"]

    def write_task(batches):
        from pyspark import TaskContext

        path = Path(target) / f"part-{TaskContext.get().partitionId():05d}.parquet"
        tmp = path.with_name(f".{path.name}.tmp")
        writer, rows = None, 0
        for batch in batches:
            if batch.num_rows == 0:
                continue
            table = pa.Table.from_batches([batch])
            table = table.cast(schema) if schema is not None else table
            if writer is None:
                writer = pq.ParquetWriter(tmp, table.schema, **options)
            writer.write_table(table, row_group_size=row_group)
            rows += table.num_rows
        if writer is not None:
            writer.close()
            tmp.replace(path)
        yield pa.RecordBatch.from_pydict({"rows": [rows]}, schema=pa.schema([("rows", pa.int64())]))

    if schema is not None:  # the frame's columns in the schema's order
        frame = frame.select(*schema.names)
    written = sum(r.rows for r in frame.mapInArrow(write_task, "rows long").collect())
    if written == 0:  # an empty partition still has its file, with the schema (as the local engine writes it)
        empty = schema.empty_table() if schema is not None else frame.limit(0).toArrow()
        write_partition(folder, empty)
    return written


def merge_parts(folder: Path, path: Path, columns: list[str] | None = None) -> int:
    """Concatenate ``folder``'s parquet files (name order: the frame's order) into the one file ``path``,
    streamed row group by row group; ``columns`` picks and orders the columns. Returns the rows written."""
    parts = sorted(folder.glob("*.parquet"))
    schema = pq.read_schema(parts[0]).remove_metadata()
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    options = {k: v for k, v in PARQUET_OPTIONS.items() if k != "row_group_size"}
    tmp, rows = path.with_name(f".{path.name}.tmp"), 0
    with pq.ParquetWriter(tmp, schema, **options) as writer:
        for part in parts:
            source = pq.ParquetFile(part)
            for group in range(source.num_row_groups):
                table = source.read_row_group(group, columns=columns).replace_schema_metadata(None)
                writer.write_table(table, row_group_size=PARQUET_OPTIONS["row_group_size"])
                rows += table.num_rows
    tmp.replace(path)
    return rows
