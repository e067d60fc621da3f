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

``engine: spark`` (``--set engine=spark``) runs steps 1-4 on Spark DataFrames (``features.spark.ingest``: the
same suites through GX's Spark datasource, the same quarantine, the accepted partitions written by the
executors; ``features.spark.derived``: the derived tables computed and written by the executors); step 5 is
shared. The steps live in ``features.ingestion`` (raw, offline, online).

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
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from features.feature_repo import FeatureStoreConfig
from features.feature_repo.tables import STATS_WINDOWS
from features.ingestion import step
from features.ingestion.offline import (
    derive_features,
    previous_accepted_count,
    write_accepted,
    write_quarantine,
)
from features.ingestion.online import publish_online
from features.ingestion.raw import TABLES, read_raw
from features.schema import ONLINE_LIST_EVENTS
from features.spark.session import SparkConfig, check_engine
from gemflow.config import save_config, to_dict
from gemflow.workspace import Workspace

log = logging.getLogger(__name__)

ONLINE_WRITERS = ("fast", "feast")


@dataclass
class IngestConfig:
    feature_store: FeatureStoreConfig = field(default_factory=FeatureStoreConfig)
    gate: dict[str, Any] = field(default_factory=dict)  # GateConfig overrides, e.g. gate.max_failure_rate=0.1
    recent_events: int = ONLINE_LIST_EVENTS  # length of the recent-events lists
    lookback_days: int = max(STATS_WINDOWS)  # history read for ad stats and recent events
    refresh_later_days: bool = True  # recompute derived tables of later ingested days whose window holds D
    materialize: bool = True
    push_recent_events: bool = True
    online_writer: str = "fast"  # fast | feast (see the module docstring)
    now: str = ""  # the gate's wall clock (ISO 8601, UTC); "" = the real clock
    engine: str = "local"  # local (pandas, one process) | spark (read, gate, offline writes on Spark)
    spark: SparkConfig = field(default_factory=SparkConfig)  # engine: spark only

    def __post_init__(self) -> None:
        if self.online_writer not in ONLINE_WRITERS:
            raise ValueError(f"online_writer must be one of {ONLINE_WRITERS}, got {self.online_writer!r}")
        check_engine(self.engine)


class DateIngestError(RuntimeError):
    """One date of a multi-date ingestion failed; ``.day`` names it, ``.cause`` is the original error (a
    ``ValidationGateError`` when the gate rejected it), ``.done`` the dates ingested before it."""

    def __init__(self, day: dt.date, cause: Exception, done: list[dt.date]) -> None:
        progress = f"{len(done)} earlier date(s) ingested" + (f" ({done[0]} .. {done[-1]})" if done else "")
        super().__init__(f"ingest stopped at {day} ({progress}): {cause}")
        self.day, self.cause, self.done = day, cause, done


def gate_config(cfg: IngestConfig):
    from features.validation import GateConfig

    try:
        return GateConfig(**cfg.gate)
    except TypeError as err:
        raise ValueError(f"ingest: bad gate override(s) {cfg.gate}: {err}") from err


def gate_now(cfg: IngestConfig) -> dt.datetime | None:
    if not cfg.now:
        return None
    now = dt.datetime.fromisoformat(cfg.now)
    return now if now.tzinfo else now.replace(tzinfo=dt.UTC)


def log_rejection(ws: Workspace, day: dt.date, table: str, result) -> None:
    log.error(
        "ingest %s: the gate rejected %s (failure rate %.3f, %s); quarantine at %s",
        day, table, result.failure_rate, result.counts, ws.quarantine(table, day),
    )  # fmt: skip


def validate_day(
    ws: Workspace, day: dt.date, cfg: IngestConfig, validate_table, quarantine=write_quarantine
) -> dict:
    """Gate every table in order (events last: they are checked against the accepted ads); on a rejection write
    every quarantine so far (no accepted data), log it and re-raise. ``validate_table(table, ads=, previous_count=,
    now=, config=)`` is one engine's gate of one table and ``quarantine(ws, result, day)`` its quarantine writer, so
    both engines share this order and this failure path."""
    from features.validation import ValidationGateError

    gate, now = gate_config(cfg), gate_now(cfg)
    previous = previous_accepted_count(ws, day)
    results: dict = {}
    for table in TABLES:
        try:
            results[table] = validate_table(
                table, ads=results["ads"].accepted if table == "events" else None,
                previous_count=previous if table == "events" else None, now=now, config=gate,
            )  # fmt: skip
        except ValidationGateError as err:
            results[table] = err.result
            for result in results.values():
                quarantine(ws, result, day)
            log_rejection(ws, day, table, err.result)
            raise
    return results


def _gate_and_write_local(ws: Workspace, day: dt.date, cfg: IngestConfig, timings: dict) -> tuple:
    with step("read raw", timings):
        raw = {table: read_raw(ws, table, day) for table in TABLES}
    with step("validate", timings):
        from features.validation import validate_partition

        def validate_table(table: str, **gate) -> object:
            return validate_partition(table, raw[table], day=day, report_dir=ws.reports(day), **gate)

        results = validate_day(ws, day, cfg, validate_table)
    with step("write offline", timings):
        derived_rows = write_accepted(ws, day, {table: r.accepted for table, r in results.items()})
        for result in results.values():
            write_quarantine(ws, result, day)
    return {table: len(frame) for table, frame in raw.items()}, results, derived_rows


def ingest(ws: Workspace, day: dt.date, cfg: IngestConfig | None = None) -> dict:
    """Ingest partition ``day``; returns (and writes to ``ws.reports(day)``) a summary of what happened."""
    cfg = cfg or IngestConfig()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    save_config(cfg, ws.reports(day), "ingest_config.yaml")

    if cfg.engine == "spark":
        from features.spark.ingest import gate_and_write

        raw_rows, results, derived_rows = gate_and_write(ws, day, cfg, timings)
    else:
        raw_rows, results, derived_rows = _gate_and_write_local(ws, day, cfg, timings)
    with step("derive features", timings):
        rows, refreshed = derive_features(ws, day, cfg)
        derived_rows.update(rows)
    online: dict = {}
    if cfg.materialize or cfg.push_recent_events:
        online = publish_online(ws, day, cfg, refreshed, timings)

    total = time.perf_counter() - t0
    summary = {
        "date": day.isoformat(),
        "engine": cfg.engine,
        "tables": {
            table: {
                "raw": raw_rows[table],
                "accepted": result.accepted_rows,
                "quarantined": result.quarantined_rows,
                "failure_rate": float(result.failure_rate),
                "reasons": {k: int(v) for k, v in result.counts.items()},
            }
            for table, result in results.items()
        },
        "derived_rows": derived_rows,
        "refreshed_days": [d.isoformat() for d in refreshed],
        "online": online,
        "timings_s": {**timings, "total": round(total, 3)},
        "events_per_second": round(raw_rows["events"] / total, 1) if total > 0 else None,
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
