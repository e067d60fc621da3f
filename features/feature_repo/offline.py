"""Reading and writing day partitions of the offline store (``ws.offline(table, D)/*.parquet``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gemflow.workspace import Workspace

# Fixed writer settings: the same rows always give the same bytes (idempotent re-runs).
PARQUET_OPTIONS = dict(
    compression="zstd",
    compression_level=3,
    use_dictionary=True,
    write_statistics=True,
    data_page_version="2.0",
    row_group_size=1 << 20,
)
PART_FILE = "part-0.parquet"


def write_partition(folder: Path, table: pa.Table, name: str = PART_FILE) -> Path:
    """Replace a partition folder's parquet content with ``table`` (overwrite, never append), atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.parquet"):
        if stale.name != name:
            stale.unlink()
    path = folder / name
    tmp = folder / f".{name}.tmp"
    pq.write_table(table.replace_schema_metadata(None), tmp, **PARQUET_OPTIONS)
    tmp.replace(path)
    return path


def partition_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.parquet"))


def read_partition(folder: Path, columns: list[str] | None = None) -> pa.Table:
    files = partition_files(folder)
    if not files:
        raise FileNotFoundError(f"no parquet files in partition {folder}")
    tables = [pq.read_table(f, columns=columns) for f in files]
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]


def partition_rows(folder: Path) -> int:
    return sum(pq.ParquetFile(f).metadata.num_rows for f in partition_files(folder))


def partition_days(ws: Workspace, kind: str, table: str) -> list[dt.date]:
    """Dates of the partitions of ``table`` under ``ws.<kind>`` (raw, offline, ...) that hold parquet files."""
    base = getattr(ws, kind)(table)
    days = []
    for folder in base.glob("date=*"):
        try:
            day = dt.date.fromisoformat(folder.name.removeprefix("date="))
        except ValueError:
            continue
        if partition_files(folder):
            days.append(day)
    return sorted(days)


def day_start(day: dt.date) -> pd.Timestamp:
    return pd.Timestamp(dt.datetime.combine(day, dt.time(), tzinfo=dt.UTC))


def day_end(day: dt.date) -> pd.Timestamp:
    return day_start(day) + pd.Timedelta(days=1)


def read_days(
    ws: Workspace, table: str, days: Iterable[dt.date], columns: list[str] | None = None
) -> pd.DataFrame:
    """Accepted rows of ``table`` for ``days`` (missing days skipped) in day order, plus ``day``: the
    partition's ``date.toordinal()`` (an int, cheap to compare over millions of rows)."""
    frames = []
    for day in days:
        folder = ws.offline(table, day)
        if not partition_files(folder):
            continue
        df = read_partition(folder, columns).to_pandas()
        df["day"] = day.toordinal()
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=[*(columns or []), "day"])
    return pd.concat(frames, ignore_index=True)
