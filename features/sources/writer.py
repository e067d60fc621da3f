"""Writes raw partitions in the exact arrow types of ``features.schema`` (shared by every source).

A partition folder is replaced as a whole, so re-running a source for a day is idempotent. Events stream into
``part-00000.parquet`` one row group at a time (bounded memory); users/ads are one snapshot file per day.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from features.schema import SCHEMAS
from gemflow.workspace import Workspace

EVENTS_FILE = "part-00000.parquet"
INJECTED_FILE = "_injected.json"


def fresh_partition(ws: Workspace, table: str, day: dt.date) -> Path:
    """An empty folder for ``table`` on ``day`` (what an earlier run left there is removed)."""
    path = ws.raw(table, day)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def day_bounds_us(day: dt.date) -> tuple[int, int]:
    """[start, end) of a UTC day in microseconds since the epoch."""
    start = dt.datetime.combine(day, dt.time(), tzinfo=dt.UTC)
    return int(start.timestamp()) * 1_000_000, int(start.timestamp() + 86_400) * 1_000_000


def strings(codes, vocabulary: tuple[str, ...]) -> pa.Array:
    """Integer codes -> a plain string array (decoded in C++, no per-row Python)."""
    dictionary = pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(vocabulary))
    return dictionary.cast(pa.string())


def arrow_table(df: pd.DataFrame, table: str) -> pa.Table:
    """A frame in the exact contract of ``table``; raises ``ValueError`` naming the column that does not fit."""
    schema = SCHEMAS[table]
    missing = [f.name for f in schema if f.name not in df.columns]
    if missing:
        raise ValueError(f"{table}: missing column(s) {missing}")
    for field in schema:
        if df[field.name].isna().any():
            raise ValueError(f"{table}.{field.name}: {int(df[field.name].isna().sum())} null value(s)")
    try:
        return pa.Table.from_pandas(df[schema.names], schema=schema, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as err:
        raise ValueError(f"{table}: a column does not fit the raw schema: {err}") from err


def corrupted_table(df: pd.DataFrame, table: str) -> pa.Table:
    """A deliberately corrupted frame (defect injection): the contract's types where they still fit (nullable,
    since ``null_field`` leaves holes), else the types arrow infers (``bad_type`` turns a column into strings)."""
    nullable = pa.schema([f.with_nullable(True) for f in SCHEMAS[table]])
    try:
        return pa.Table.from_pandas(df, schema=nullable, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, KeyError):
        return pa.Table.from_pandas(df, preserve_index=False)


def write_snapshot(ws: Workspace, table: str, day: dt.date, data: pa.Table) -> Path:
    path = fresh_partition(ws, table, day) / f"{table}.parquet"
    pq.write_table(data, path)
    return path


def write_injected(folder: Path, counts: dict[str, int], rates: dict[str, float]) -> Path:
    path = folder / INJECTED_FILE
    path.write_text(json.dumps({"rates": rates, "rows": counts}, indent=2, sort_keys=True))
    return path
