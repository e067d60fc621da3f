"""Daily ingestion (``gemflow ingest --date D``): raw partition D -> validation gate -> offline store -> Feast.

Steps, each logged with its duration:
1. read ``ws.raw(users|ads|events, D)`` (events: plus the live event path's export, ``ws.raw("live_events", D)``);
2. validate users, ads, then events (against the accepted ads snapshot, volume vs the previous accepted events
   partition) with ``features.validation``; a failing gate writes the quarantine (and nothing else) and re-raises;
3. write accepted rows to ``ws.offline(table, D)`` (deterministic order, fixed writer settings, overwrite) and
   rejected rows to ``ws.quarantine(table, D)``;
4. derive the feature tables as of D's end from the accepted offline history (``features.stats``) — and refresh
   the derived tables of later days already ingested whose windows include D, so dates may arrive in any order;
5. ``feast apply``, materialize the batch views over [D 00:00, end of the newest ingested day] (keyed on the
   logical date: an Airflow 3 cron run has data_interval_start == data_interval_end), push the fresh recent
   events online (never to the offline store: that appends). ``online_writer: fast`` (the default) does both with
   ``features.feature_repo.online`` (Feast's semantics and storage layout, values encoded vectorized);
   ``feast`` calls ``FeatureStore.materialize`` / ``push`` (same online values, ~10x slower).

Running a date twice leaves byte-identical offline partitions and identical online values. The run's config and
a JSON summary land in ``ws.reports(D)``.

``ingest_days`` (``gemflow ingest --start D1 --end D2`` / ``--dates``) runs ``ingest`` for many dates, oldest
first, in one process (a backfill of a 213-day log pays the interpreter, GX and Feast start-up once instead of
213 times); each date keeps its own semantics, reports and idempotency, and the first failing date stops the run
with ``DateIngestError`` naming it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from features import recent_events
from features.feature_repo import FeatureStoreConfig
from features.feature_repo.offline import (
    day_end,
    day_start,
    partition_days,
    partition_files,
    partition_rows,
    read_partition,
    write_partition,
)
from features.feature_repo.tables import EVENT_TS, STATS_WINDOWS
from features.schema import RECENT_EVENTS, SCHEMAS
from features.stats import (
    ad_attributes_table,
    ad_serving_table,
    ad_stats_table,
    read_events,
    recent_events_table,
    user_profile_table,
)
from gemflow.config import save_config, to_dict
from gemflow.workspace import Workspace

log = logging.getLogger(__name__)

LIVE_EVENTS = "live_events"  # the live event path's export (serving.events.export.LIVE_TABLE)
TABLES = ("users", "ads", "events")  # validation order: events are checked against the accepted ads
BATCH_VIEWS = ["user_profile", "ad_attributes", "ad_stats"]  # materialized; recent events are pushed
SORT_KEYS = {"users": ["user_id"], "ads": ["ad_id"], "events": ["ts", "event_id"]}
ONLINE_WRITERS = ("fast", "feast")


@dataclass
class IngestConfig:
    feature_store: FeatureStoreConfig = field(default_factory=FeatureStoreConfig)
    gate: dict[str, Any] = field(default_factory=dict)  # GateConfig overrides, e.g. gate.max_failure_rate=0.1
    recent_events: int = RECENT_EVENTS  # length of the recent-events lists
    lookback_days: int = max(STATS_WINDOWS)  # history read for ad stats and recent events
    refresh_later_days: bool = True  # recompute derived tables of later ingested days whose window holds D
    materialize: bool = True
    push_recent_events: bool = True
    online_writer: str = "fast"  # fast | feast (see the module docstring)
    now: str = ""  # the gate's wall clock (ISO 8601, UTC); "" = the real clock

    def __post_init__(self) -> None:
        if self.online_writer not in ONLINE_WRITERS:
            raise ValueError(f"online_writer must be one of {ONLINE_WRITERS}, got {self.online_writer!r}")


class IngestError(RuntimeError):
    """The raw partition is missing or unreadable."""


class DateIngestError(RuntimeError):
    """One date of a multi-date ingestion failed; ``.day`` names it, ``.cause`` is the original error (a
    ``ValidationGateError`` when the gate rejected it), ``.done`` the dates ingested before it."""

    def __init__(self, day: dt.date, cause: Exception, done: list[dt.date]) -> None:
        progress = f"{len(done)} earlier date(s) ingested" + (f" ({done[0]} .. {done[-1]})" if done else "")
        super().__init__(f"ingest stopped at {day} ({progress}): {cause}")
        self.day, self.cause, self.done = day, cause, done


@contextmanager
def _step(name: str, timings: dict[str, float]):
    log.info("ingest: %s ...", name)
    t0 = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - t0, 3)
    log.info("ingest: %s done in %.2fs", name, timings[name])


def read_raw(ws: Workspace, table: str, day: dt.date) -> pd.DataFrame:
    """The raw partition of ``table`` on ``day``. Events are the batch landing plus the live event path's export
    (``ws.raw(LIVE_EVENTS, day)``, ``serving.events.export``): an event both delivered, identical, counts once;
    anything else (a replay inside one source, one id with two contents) is left to the gate."""
    folders = [ws.raw(table, day)] + ([ws.raw(LIVE_EVENTS, day)] if table == "events" else [])
    frames = [_read_files(partition_files(folder)) for folder in folders]
    present = [f for f in frames if f is not None]
    if not present:
        raise IngestError(
            f"no raw {table} partition for {day} at {folders[0]} (land it with `gemflow generate` or an "
            f"importer first)"
        )
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


def _gate_config(cfg: IngestConfig):
    from features.validation import GateConfig

    try:
        return GateConfig(**cfg.gate)
    except TypeError as err:
        raise ValueError(f"ingest: bad gate override(s) {cfg.gate}: {err}") from err


def _now(cfg: IngestConfig) -> dt.datetime | None:
    if not cfg.now:
        return None
    now = dt.datetime.fromisoformat(cfg.now)
    return now if now.tzinfo else now.replace(tzinfo=dt.UTC)


def previous_accepted_count(ws: Workspace, day: dt.date) -> int | None:
    """Rows of the nearest accepted events partition before ``day`` (the gate's volume baseline)."""
    earlier = [d for d in partition_days(ws, "offline", "events") if d < day]
    return partition_rows(ws.offline("events", earlier[-1])) if earlier else None


def _accepted_table(table: str, df: pd.DataFrame) -> pa.Table:
    ordered = df.sort_values(SORT_KEYS[table], kind="stable", ignore_index=True)
    return pa.Table.from_pandas(ordered, schema=SCHEMAS[table], preserve_index=False)


def _quarantine_table(df: pd.DataFrame) -> pa.Table:
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


def _write_quarantine(ws: Workspace, result, day: dt.date) -> None:
    write_partition(
        ws.quarantine(result.table, day), _quarantine_table(result.quarantined.reset_index(drop=True))
    )


def validate_day(ws: Workspace, day: dt.date, cfg: IngestConfig, raw: dict[str, pd.DataFrame]) -> dict:
    """Gate every table; on failure write the quarantines (no accepted data) and re-raise."""
    from features.validation import ValidationGateError, validate_partition

    gate, now = _gate_config(cfg), _now(cfg)
    previous = previous_accepted_count(ws, day)
    results: dict = {}
    for table in TABLES:
        try:
            results[table] = validate_partition(
                table,
                raw[table],
                day=day,
                report_dir=ws.reports(day),
                ads=results["ads"].accepted if table == "events" else None,
                previous_count=previous if table == "events" else None,
                now=now,
                config=gate,
            )
        except ValidationGateError as err:
            results[table] = err.result
            for result in results.values():
                _write_quarantine(ws, result, day)
            log.error(
                "ingest %s: the gate rejected %s (failure rate %.3f, %s); quarantine at %s",
                day,
                table,
                err.result.failure_rate,
                err.result.counts,
                ws.quarantine(table, day),
            )
            raise
    return results


def derive_day(ws: Workspace, day: dt.date, cfg: IngestConfig) -> dict[str, pa.Table]:
    """Ad stats and recent events as of ``day``'s end, from the accepted offline history."""
    window = [day - dt.timedelta(days=k) for k in range(cfg.lookback_days - 1, -1, -1)]
    events = read_events(ws, window)
    ad_ids = read_partition(ws.offline("ads", day), ["ad_id"]).column("ad_id").to_numpy()
    return {
        "ad_stats": ad_stats_table(events, ad_ids, day),
        "user_recent_events": recent_events_table(events, day, cfg.recent_events),
    }


def write_accepted(ws: Workspace, day: dt.date, accepted: dict[str, pd.DataFrame]) -> dict[str, int]:
    """Accepted users/ads/events of ``day`` -> offline partitions, plus the day's profile and attribute rows."""
    for table, df in accepted.items():
        write_partition(ws.offline(table, day), _accepted_table(table, df))
    return {
        "user_profile": write_table(ws, "user_profile", day, user_profile_table(accepted["users"], day)),
        "ad_attributes": write_table(ws, "ad_attributes", day, ad_attributes_table(accepted["ads"], day)),
        "ad_serving": write_table(ws, "ad_serving", day, ad_serving_table(accepted["ads"], day)),
    }


def derive_features(ws: Workspace, day: dt.date, cfg: IngestConfig) -> tuple[dict[str, int], dict]:
    """Write ad stats and recent events as of ``day`` (and of later ingested days whose window holds it).

    Returns the rows written for ``day`` and the recent-events tables per refreshed day (oldest first)."""
    horizon = day + dt.timedelta(days=cfg.lookback_days - 1)
    ingested = partition_days(ws, "offline", "events")
    later = [d for d in ingested if day < d <= horizon] if cfg.refresh_later_days else []
    rows: dict[str, int] = {}
    recent: dict[dt.date, pa.Table] = {}
    refreshed = [day, *later]
    for d in tqdm(refreshed, desc="derive features", unit="day", disable=len(refreshed) < 2):
        tables = derive_day(ws, d, cfg)
        for name, table in tables.items():
            written = write_table(ws, name, d, table)
            if d == day:
                rows[name] = written
        recent[d] = tables["user_recent_events"]
    return rows, recent


def publish_online(
    ws: Workspace, day: dt.date, cfg: IngestConfig, recent: dict, timings: dict[str, float] | None = None
) -> dict:
    """feast apply; materialize the batch views from ``day``'s start to the newest ingested day's end; push the
    recent events of the refreshed days online (oldest first, so the newest rows win)."""
    from features.feature_repo import online as online_writes
    from features.store import open_store

    timings = {} if timings is None else timings
    newest = partition_days(ws, "offline", "events")[-1]
    online: dict = {"materialized": [], "pushed_rows": 0}
    with _step("feast apply", timings):
        store = open_store(ws, cfg.feature_store, apply=True)
    fast = cfg.online_writer == "fast"
    if cfg.materialize:
        start, end = day_start(day).to_pydatetime(), day_end(newest).to_pydatetime()
        with _step("materialize", timings):
            if fast:
                online_writes.materialize(store, BATCH_VIEWS, start, end)
            else:
                store.materialize(start, end, BATCH_VIEWS)
        online["materialized"] = [start.isoformat(), end.isoformat()]
    if not cfg.push_recent_events:
        return online
    if newest not in recent:
        # A backfill older than the look-back window must not overwrite newer online values with stale ones.
        log.warning(
            "ingest %s: the newest day %s lies outside the look-back window; online recent events kept",
            day,
            newest,
        )
        return online
    tables = [table for table in recent.values() if table.num_rows]
    with _step("push recent events", timings):
        if tables:
            # Merged into what is online (``features.recent_events``): a live event newer than the day's end
            # stays, a re-run changes nothing.
            events, as_of = recent_push_events(tables)
            recent_events.merge_online(store, events, cfg.recent_events, as_of, fast=fast)
        online["pushed_rows"] = sum(table.num_rows for table in tables)
    return online


def recent_push_events(tables: list[pa.Table]) -> tuple[pd.DataFrame, dict[int, int]]:
    """The events of the recent-events tables of the refreshed days (long form), and each user's newest row time
    (µs) among them: the time the merged row is as of."""
    combined = pa.concat_tables(tables)
    stamps = combined.column(EVENT_TS).cast(pa.int64()).to_numpy()
    users = combined.column("user_id").to_numpy()
    as_of: dict[int, int] = {}
    for user, stamp in zip(users.tolist(), stamps.tolist(), strict=True):
        as_of[user] = max(stamp, as_of.get(user, stamp))
    return recent_events.from_view_rows(combined), as_of


def ingest(ws: Workspace, day: dt.date, cfg: IngestConfig | None = None) -> dict:
    """Ingest partition ``day``; returns (and writes to ``ws.reports(day)``) a summary of what happened."""
    cfg = cfg or IngestConfig()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    save_config(cfg, ws.reports(day), "ingest_config.yaml")

    with _step("read raw", timings):
        raw = {table: read_raw(ws, table, day) for table in TABLES}
    with _step("validate", timings):
        results = validate_day(ws, day, cfg, raw)
    with _step("write offline", timings):
        derived_rows = write_accepted(ws, day, {table: r.accepted for table, r in results.items()})
        for result in results.values():
            _write_quarantine(ws, result, day)
    with _step("derive features", timings):
        rows, recent = derive_features(ws, day, cfg)
        derived_rows.update(rows)
    online: dict = {}
    if cfg.materialize or cfg.push_recent_events:
        online = publish_online(ws, day, cfg, recent, timings)

    total = time.perf_counter() - t0
    events_in = len(raw["events"])
    summary = {
        "date": day.isoformat(),
        "tables": {
            table: {
                "raw": len(raw[table]),
                "accepted": len(result.accepted),
                "quarantined": len(result.quarantined),
                "failure_rate": float(result.failure_rate),
                "reasons": {k: int(v) for k, v in result.counts.items()},
            }
            for table, result in results.items()
        },
        "derived_rows": derived_rows,
        "refreshed_days": [d.isoformat() for d in recent],
        "online": online,
        "timings_s": {**timings, "total": round(total, 3)},
        "events_per_second": round(events_in / total, 1) if total > 0 else None,
        "config": to_dict(cfg),
    }
    out = ws.reports(day) / "ingest_summary.json"
    out.write_text(json.dumps(summary, indent=2))
    log.info(
        "ingest %s: %s accepted events, %s quarantined, %.1fs -> %s",
        day,
        summary["tables"]["events"]["accepted"],
        summary["tables"]["events"]["quarantined"],
        total,
        out,
    )
    return summary


def write_table(ws: Workspace, name: str, day: dt.date, table: pa.Table) -> int:
    write_partition(ws.offline(name, day), table)
    return table.num_rows


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


def ingest_days(ws: Workspace, days: list[dt.date], cfg: IngestConfig | None = None) -> dict:
    """``ingest`` every date of ``days`` (oldest first) in this process; stops at the first failing date with a
    ``DateIngestError``. Returns a short summary (each date's full summary is in its reports folder)."""
    cfg = cfg or IngestConfig()
    if not days:
        raise ValueError("no dates to ingest")
    ordered = sorted(set(days))
    t0 = time.perf_counter()
    done: list[dt.date] = []
    per_date: dict[str, dict] = {}
    bar = tqdm(ordered, desc="ingest", unit="day")
    for day in bar:
        bar.set_postfix_str(day.isoformat())
        try:
            summary = ingest(ws, day, cfg)
        except Exception as err:  # noqa: BLE001 - re-raised with the failing date named, cause kept
            bar.close()
            raise DateIngestError(day, err, done) from err
        done.append(day)
        events = summary["tables"]["events"]
        per_date[day.isoformat()] = {
            "accepted": events["accepted"],
            "quarantined": events["quarantined"],
            "seconds": summary["timings_s"]["total"],
        }
    total = time.perf_counter() - t0
    return {
        "dates": len(done),
        "first": done[0].isoformat(),
        "last": done[-1].isoformat(),
        "accepted_events": sum(d["accepted"] for d in per_date.values()),
        "quarantined_events": sum(d["quarantined"] for d in per_date.values()),
        "seconds": round(total, 1),
        "seconds_per_date": round(total / len(done), 2),
        "per_date": per_date,
    }
