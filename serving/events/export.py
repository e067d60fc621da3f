"""Exactly-once export of the durable event log into the raw event log the daily ingest reads.

Each export is a rowid range of the log, recorded (``exports``, not done) before any file is written; its events
land in ``ws.raw("live_events", D)/live-<lo>-<hi>.parquet`` for each UTC day D they fall on (the raw events
contract, ``features.schema.EVENTS_SCHEMA``), each file written to a temporary name, fsynced and renamed; then the
range is marked done. A crash anywhere re-runs the recorded range with the same file names: a file is replaced,
never doubled. The ingest reads this folder beside the batch landing (``features.ingestion.raw.read_raw``) and counts an
event delivered by both once.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from features.ingestion.raw import LIVE_EVENTS
from features.schema import ACTIONS, EVENTS_SCHEMA, SURFACES
from features.sources.writer import strings
from gemflow.workspace import Workspace
from serving.events.log import connect

log = logging.getLogger(__name__)
LIVE_TABLE = LIVE_EVENTS  # ws.raw(LIVE_TABLE, D): the live path's share of the raw event log
DAY_US = 86_400_000_000
MAX_ROWS = 1_000_000  # per export range


def _write_atomic(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _raw_table(rows: list[tuple]) -> pa.Table:
    event_id, user_id, ad_id, action, surface, ts_us, click, conversion = np.array(rows, np.int64).T
    order = np.lexsort((event_id, ts_us))
    return pa.table(
        {
            "event_id": pa.array(event_id[order]),
            "user_id": pa.array(user_id[order]),
            "ad_id": pa.array(ad_id[order]),
            "action": strings(action[order], ACTIONS),
            "surface": strings(surface[order], SURFACES),
            "ts": pa.array(ts_us[order], pa.timestamp("us", tz="UTC")),
            "click": pa.array(click[order], pa.int8()),
            "conversion": pa.array(conversion[order], pa.int8()),
        },
        schema=EVENTS_SCHEMA,
    )


def export(conn: sqlite3.Connection, ws: Workspace) -> dict:
    """Record the next range of logged events, then write every recorded range not done yet. Returns what it
    wrote: ``{"ranges": [...], "events": n, "files": [...]}``."""
    with conn:
        conn.execute("BEGIN IMMEDIATE")
        last = conn.execute("SELECT COALESCE(MAX(hi), 0) FROM exports").fetchone()[0]
        hi = conn.execute(
            "SELECT MAX(seq) FROM (SELECT seq FROM events WHERE seq > ? ORDER BY seq LIMIT ?)",
            (last, MAX_ROWS),
        ).fetchone()[0]
        if hi is not None:
            conn.execute("INSERT INTO exports (lo, hi) VALUES (?, ?)", (last + 1, hi))
    out: dict = {"ranges": [], "events": 0, "files": []}
    for lo, hi in conn.execute("SELECT lo, hi FROM exports WHERE done = 0 ORDER BY lo").fetchall():
        rows = conn.execute(
            "SELECT event_id, user_id, ad_id, action, surface, ts_us, click, conversion FROM events "
            "WHERE seq BETWEEN ? AND ? ORDER BY seq",
            (lo, hi),
        ).fetchall()
        by_day: dict[int, list[tuple]] = {}
        for row in rows:
            by_day.setdefault(row[5] // DAY_US, []).append(row)
        for day_number, day_rows in sorted(by_day.items()):
            day = dt.date(1970, 1, 1) + dt.timedelta(days=day_number)
            path = ws.raw(LIVE_TABLE, day) / f"live-{lo:012d}-{hi:012d}.parquet"
            _write_atomic(_raw_table(day_rows), path)
            out["files"].append(str(path))
        with conn:
            conn.execute("UPDATE exports SET done = 1 WHERE lo = ? AND hi = ?", (lo, hi))
        out["ranges"].append([lo, hi])
        out["events"] += len(rows)
    return out


class Exporter:
    """Runs ``export`` every ``every_s`` on its own connection (the writer keeps appending meanwhile)."""

    def __init__(self, path: Path, ws: Workspace, every_s: float):
        self.path, self.ws, self.every_s = path, ws, every_s
        self.exported = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="events-export", daemon=True)

    def start(self) -> None:
        if self.every_s > 0:
            self._thread.start()

    def _run(self) -> None:
        conn = connect(self.path)
        try:
            while not self._stop.wait(self.every_s):
                self.run_once(conn)
            self.run_once(conn)
        finally:
            conn.close()

    def run_once(self, conn: sqlite3.Connection) -> None:
        try:
            self.exported += export(conn, self.ws)["events"]
        except Exception:  # noqa: BLE001  a full disk must not stop the collector: the next round retries
            log.exception("events: export into the raw event log failed (retried in %.0fs)", self.every_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
