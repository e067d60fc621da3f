"""Offline-store writes of an ingestion: accepted rows (contract types, deterministic order, fixed writer
settings, overwrite), quarantined rows, and the feature tables derived as of a day's end."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import pandas as pd
import pyarrow as pa
from tqdm.auto import tqdm

from features.feature_repo.offline import partition_days, partition_rows, read_partition, write_partition
from features.schema import SCHEMAS
from features.stats import (
    ad_attributes_table,
    ad_serving_table,
    ad_stats_table,
    read_events,
    recent_events_table,
    user_profile_table,
)
from gemflow.workspace import Workspace

SORT_KEYS = {"users": ["user_id"], "ads": ["ad_id"], "events": ["ts", "event_id"]}


def previous_accepted_count(ws: Workspace, day: dt.date) -> int | None:
    """Rows of the nearest accepted events partition before ``day`` (the gate's volume baseline)."""
    earlier = [d for d in partition_days(ws, "offline", "events") if d < day]
    return partition_rows(ws.offline("events", earlier[-1])) if earlier else None


def accepted_table(table: str, df: pd.DataFrame) -> pa.Table:
    ordered = df.sort_values(SORT_KEYS[table], kind="stable", ignore_index=True)
    return pa.Table.from_pandas(ordered, schema=SCHEMAS[table], preserve_index=False)


def quarantine_table(df: pd.DataFrame) -> pa.Table:
    try:
        return pa.Table.from_pandas(df, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        # Mixed values (numbers and unparseable strings) in one column: keep them all, as text.
        text = df.copy()
        for col in text.columns:
            if pd.api.types.is_object_dtype(text[col]):
                text[col] = text[col].map(_text)
        return pa.Table.from_pandas(text, preserve_index=False)


def _text(value: Any) -> str | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def write_quarantine(ws: Workspace, result, day: dt.date) -> None:
    write_partition(
        ws.quarantine(result.table, day), quarantine_table(result.quarantined.reset_index(drop=True))
    )


def write_table(ws: Workspace, name: str, day: dt.date, table: pa.Table) -> int:
    write_partition(ws.offline(name, day), table)
    return table.num_rows


def write_snapshot_features(ws: Workspace, day: dt.date, users: pd.DataFrame, ads: pd.DataFrame) -> dict:
    """The day's profile and attribute rows from its accepted users and ads."""
    return {
        "user_profile": write_table(ws, "user_profile", day, user_profile_table(users, day)),
        "ad_attributes": write_table(ws, "ad_attributes", day, ad_attributes_table(ads, day)),
        "ad_serving": write_table(ws, "ad_serving", day, ad_serving_table(ads, day)),
    }


def write_accepted(ws: Workspace, day: dt.date, accepted: dict[str, pd.DataFrame]) -> dict[str, int]:
    """Accepted users/ads/events of ``day`` -> offline partitions, plus the day's profile and attribute rows."""
    for table, df in accepted.items():
        write_partition(ws.offline(table, day), accepted_table(table, df))
    return write_snapshot_features(ws, day, accepted["users"], accepted["ads"])


def derive_day(ws: Workspace, day: dt.date, cfg) -> dict[str, pa.Table]:
    """Ad stats and recent events as of ``day``'s end, from the accepted offline history."""
    window = [day - dt.timedelta(days=k) for k in range(cfg.lookback_days - 1, -1, -1)]
    events = read_events(ws, window)
    ad_ids = read_partition(ws.offline("ads", day), ["ad_id"]).column("ad_id").to_numpy()
    return {
        "ad_stats": ad_stats_table(events, ad_ids, day),
        "user_recent_events": recent_events_table(events, day, cfg.recent_events),
    }


def derive_features(ws: Workspace, day: dt.date, cfg) -> tuple[dict[str, int], list[dt.date]]:
    """Write ad stats and recent events as of ``day`` (and of later ingested days whose window holds it).

    Returns the rows written for ``day`` and the days refreshed (oldest first)."""
    horizon = day + dt.timedelta(days=cfg.lookback_days - 1)
    ingested = partition_days(ws, "offline", "events")
    later = [d for d in ingested if day < d <= horizon] if cfg.refresh_later_days else []
    rows: dict[str, int] = {}
    refreshed = [day, *later]
    for d in tqdm(refreshed, desc="derive features", unit="day", disable=len(refreshed) < 2):
        if cfg.engine == "spark":
            from features.spark.derived import write_derived_day
            from features.spark.session import spark_session

            written = write_derived_day(spark_session(cfg.spark), ws, d, cfg)
        else:
            tables = derive_day(ws, d, cfg)
            written = {name: write_table(ws, name, d, table) for name, table in tables.items()}
        if d == day:
            rows.update(written)
    return rows, refreshed
