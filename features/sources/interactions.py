"""The generic importer: any interaction log -> the raw contract of ``features.schema`` (see
``docs/interaction-format.md``).

Input: one row per (user, item) interaction, as CSV/TSV/parquet or a DataFrame, with a timestamp or an order
within the user, optionally a label or a rating, item attributes and user attributes (inline or in separate
item/user tables). Output: day partitions of events, and per day snapshots of the users and ads known by then.

Mapping: items become ads (advertiser = a chosen item column or 0, categories = the attribute list, the first one
is ``category_id``, quality 0.5); each interaction is an ``impression`` whose click label is the row's label, and
a positive one is followed by a ``click`` event 1 s later (a strong positive, e.g. rating 5, also by a
``conversion`` 2 s later). Rows without label or rating become an organic action (``unlabeled_action``).
Integer ids >= 0 are kept; any other id (strings) becomes a stable int64 (64-bit BLAKE2b of its text, top bit
cleared), so the same id gets the same number in every file and run. Categorical attributes become small ids by
their sorted vocabulary, written to the run folder with the id maps.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from features.schema import TS
from features.sources import writer
from features.sources.interaction_columns import entity_ids, events_table, labels, timestamps_us
from features.sources.interaction_entities import ads_table, users_table
from features.sources.interaction_format import (
    InteractionFormat,
    InteractionFormatError,
    check_format,
    read_table,
    unused_conversion_columns,
)
from features.sources.interaction_rows import RowFormatError, quarantine_rows
from gemflow.config import save_config
from gemflow.workspace import Workspace


@dataclass
class RawLog:
    """The converted log, before it is split into day partitions."""

    events: pa.Table  # EVENTS_SCHEMA, sorted by (ts, user, input order)
    users: pa.Table  # USERS_SCHEMA (signup_ts = first interaction)
    ads: pa.Table  # ADS_SCHEMA (created_ts = first interaction)
    stats: dict[str, Any] = field(default_factory=dict)
    vocabularies: dict[str, list[str]] = field(default_factory=dict)
    id_maps: dict[str, pd.DataFrame] = field(default_factory=dict)  # raw id -> int64, where ids were hashed
    quarantined: pd.DataFrame | None = None  # bad input rows: ``row`` (1-based), ``reason``, their columns


def import_interactions(
    interactions: str | Path | pd.DataFrame,
    fmt: InteractionFormat,
    ws: Workspace,
    *,
    items: str | Path | pd.DataFrame | None = None,
    users: str | Path | pd.DataFrame | None = None,
    source: str = "interactions",
    progress: bool = True,
) -> dict[str, Any]:
    """Convert and write day partitions into ``ws``; record the format, vocabularies and id maps of the run.
    Bad rows go to the run folder's ``quarantine.parquet`` with their row number and reason."""
    name = "interactions" if isinstance(interactions, pd.DataFrame) else str(interactions)
    try:
        frame = read_table(interactions, fmt.delimiter, fmt.encoding)
        log = to_raw(
            frame,
            fmt,
            items=None if items is None else read_table(items, fmt.delimiter, fmt.encoding),
            users=None if users is None else read_table(users, fmt.delimiter, fmt.encoding),
        )
    except InteractionFormatError as err:
        text = str(err)
        raise InteractionFormatError(text if text.startswith(name) else f"{name}: {text}") from None
    days = write_raw(log, ws, progress=progress)
    summary = {"source": source, **log.stats, "days": len(days), "first_day": days[0], "last_day": days[-1]}
    summary["warnings"] = unused_conversion_columns(frame, fmt)
    if log.stats["quarantined"]:
        summary["warnings"].append(
            f"{log.stats['quarantined']} bad row(s) quarantined (not imported): {log.stats['quarantine_reasons']}"
        )
    run_dir = ws.raw("_runs") / f"{source}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S%fZ}"
    save_config(fmt, run_dir)
    if log.quarantined is not None and len(log.quarantined):
        path = run_dir / "quarantine.parquet"
        log.quarantined.astype({c: "string" for c in log.quarantined.columns if c != "row"}).to_parquet(
            path, index=False
        )
        summary["quarantine"] = str(path)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "vocabularies.json").write_text(json.dumps(log.vocabularies, indent=2))
    for name, mapping in log.id_maps.items():
        mapping.to_parquet(run_dir / f"{name}_ids.parquet", index=False)
    summary["run_dir"] = str(run_dir)
    return summary


def write_raw(log: RawLog, ws: Workspace, *, progress: bool = True) -> list[str]:
    """One partition per day that has events: events of that day, users and ads known by its end."""
    ts = log.events["ts"].cast(pa.int64()).to_numpy()
    day_us = 86_400 * 1_000_000
    first, last = ts[0] // day_us, ts[-1] // day_us
    written = []
    for day_number in tqdm(range(first, last + 1), desc="import days", unit="day", disable=not progress):
        lo, hi = np.searchsorted(ts, [day_number * day_us, (day_number + 1) * day_us])
        if lo == hi:
            continue  # no events that day: no partition (an empty one would read as a volume drop)
        day = dt.date(1970, 1, 1) + dt.timedelta(days=int(day_number))
        end = pa.scalar((day_number + 1) * day_us, TS)
        folder = writer.fresh_partition(ws, "events", day)
        pq.write_table(log.events.slice(lo, hi - lo), folder / writer.EVENTS_FILE)
        writer.write_snapshot(ws, "users", day, log.users.filter(pc.less(log.users["signup_ts"], end)))
        writer.write_snapshot(ws, "ads", day, log.ads.filter(pc.less(log.ads["created_ts"], end)))
        written.append(day.isoformat())
    return written


def to_raw(
    interactions: pd.DataFrame,
    fmt: InteractionFormat,
    *,
    items: pd.DataFrame | None = None,
    users: pd.DataFrame | None = None,
) -> RawLog:
    check_format(fmt, interactions, items, users)
    if interactions.empty:
        raise InteractionFormatError("the interaction log has no rows")
    try:
        frame, quarantined = quarantine_rows(interactions.reset_index(drop=True), fmt)
    except RowFormatError as err:
        raise InteractionFormatError(str(err)) from None
    frame = frame.reset_index(drop=True)
    id_maps: dict[str, pd.DataFrame] = {}
    user_id = entity_ids(frame[fmt.user_col], fmt.user_col, "user", id_maps)
    item_id = entity_ids(frame[fmt.item_col], fmt.item_col, "item", id_maps)
    ts_us = timestamps_us(frame, fmt, user_id)
    label, strong = labels(frame, fmt)

    # Sort once by (time, user, input order): event ids and partitions follow this order.
    order = np.lexsort((np.arange(len(frame)), user_id, ts_us))
    frame, user_id, item_id, ts_us = (
        frame.iloc[order].reset_index(drop=True),
        user_id[order],
        item_id[order],
        ts_us[order],
    )
    label = None if label is None else label[order]
    strong = None if strong is None else strong[order]

    events = events_table(fmt, user_id, item_id, ts_us, label, strong)
    vocabularies: dict[str, list[str]] = {}
    ads = ads_table(frame, fmt, items, item_id, ts_us, vocabularies, id_maps)
    user_table, stats = users_table(frame, fmt, users, user_id, ts_us, vocabularies, id_maps)
    stats.update(
        interactions=len(frame),
        events=events.num_rows,
        positives=int(label.sum()) if label is not None else 0,
        conversions=int(strong.sum()) if strong is not None else 0,
        users=user_table.num_rows,
        items=ads.num_rows,
        quarantined=len(quarantined),
        quarantine_reasons=quarantined["reason"].value_counts().to_dict(),
    )
    return RawLog(events, user_table, ads, stats, vocabularies, id_maps, quarantined)
