"""The raw partitions an ingestion reads: ``ws.raw(users|ads|events, D)``, events plus the live event path's
export (``ws.raw(LIVE_EVENTS, D)``), and the dates that have one."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from features.feature_repo.offline import partition_days, partition_files
from features.schema import SCHEMAS
from gemflow.workspace import Workspace

LIVE_EVENTS = "live_events"  # the live event path's export (serving.events.export.LIVE_TABLE)
TABLES = ("users", "ads", "events")  # validation order: events are checked against the accepted ads


class IngestError(RuntimeError):
    """The raw partition is missing or unreadable."""


def raw_folders(ws: Workspace, table: str, day: dt.date) -> list:
    """Where ``table``'s raw rows of ``day`` land, in reading order (batch landing first)."""
    return [ws.raw(table, day)] + ([ws.raw(LIVE_EVENTS, day)] if table == "events" else [])


def missing_partition(ws: Workspace, table: str, day: dt.date) -> IngestError:
    return IngestError(
        f"no raw {table} partition for {day} at {ws.raw(table, day)} (land it with `gemflow generate` or an "
        f"importer first)"
    )


def read_raw(ws: Workspace, table: str, day: dt.date) -> pd.DataFrame:
    """The raw partition of ``table`` on ``day``. Events are the batch landing plus the live event path's export
    (``ws.raw(LIVE_EVENTS, day)``, ``serving.events.export``): an event both delivered, identical, counts once;
    anything else (a replay inside one source, one id with two contents) is left to the gate."""
    frames = [_read_files(partition_files(folder)) for folder in raw_folders(ws, table, day)]
    present = [f for f in frames if f is not None]
    if not present:
        raise missing_partition(ws, table, day)
    if len(present) == 1:
        return present[0]
    batch, live = present
    return pd.concat([batch, live[~delivered_twice(batch, live)]], ignore_index=True)


def _read_files(files: list) -> pd.DataFrame | None:
    if not files:
        return None
    # One file at a time: a corrupted file may carry its own inferred schema (e.g. strings in an int column).
    frames = [pq.read_table(f).to_pandas() for f in files]
    return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]


def delivered_twice(batch: pd.DataFrame, live: pd.DataFrame) -> np.ndarray:
    """Per live row: whether the batch landing holds the same event (same event id, every field equal)."""
    ids = pd.to_numeric(batch["event_id"], errors="coerce")
    candidates = batch[ids.isin(live["event_id"])]
    if candidates.empty:
        return np.zeros(len(live), bool)
    columns = list(SCHEMAS["events"].names)

    def keys(frame: pd.DataFrame) -> pd.Series:
        return frame[columns].astype(str).agg("\x1f".join, axis=1)

    return keys(live).isin(set(keys(candidates))).to_numpy()


def raw_days(ws: Workspace, start: dt.date, end: dt.date) -> list[dt.date]:
    """The dates in [start, end] that have a raw events partition (a log has no partition for a day without
    events; such days are not errors)."""
    if end < start:
        raise ValueError(f"the range ends ({end}) before it starts ({start})")
    landed = set(partition_days(ws, "raw", "events")) | set(partition_days(ws, "raw", LIVE_EVENTS))
    days = sorted(d for d in landed if start <= d <= end)
    if not days:
        raise IngestError(f"no raw events partition between {start} and {end} under {ws.raw('events')}")
    return days
