"""The durable event log: a local SQLite file (WAL, ``synchronous=FULL``) that an event is in before it is
acknowledged.

- ``events``: one row per ``event_id`` (PRIMARY KEY; ``INSERT OR IGNORE``: a client's retry is a no-op), with the
  rowid as the arrival sequence, and ``online`` = 1 once the event is in the user's online list (set in the next
  commit after the online write; rows still 0 at start-up are merged again: the merge is idempotent).
- ``quarantine``: refused events, each with its reason and the payload as received (an event reusing a logged
  id with other content: the checked event).
- ``exports``: the rowid ranges exported into the raw event log (``serving.events.export``).

One connection per thread; the writer thread is the only one that appends.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict, fields
from pathlib import Path

from serving.events.validate import Event

COLUMNS = tuple(f.name for f in fields(Event))
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,
    {", ".join(f"{c} INTEGER NOT NULL" + (" UNIQUE" if c == "event_id" else "") for c in COLUMNS)},
    received_us INTEGER NOT NULL,
    online INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS events_not_online ON events(online) WHERE online = 0;
CREATE TABLE IF NOT EXISTS quarantine (
    id INTEGER PRIMARY KEY, received_us INTEGER NOT NULL, reason TEXT NOT NULL, detail TEXT NOT NULL,
    payload TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS exports (lo INTEGER NOT NULL, hi INTEGER NOT NULL, done INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (lo, hi));
"""
NEW, DUPLICATE, CONFLICT = "new", "duplicate", "conflict"
ID_CHUNK = 5000  # event ids per lookup (SQLite caps bound parameters)
CONFLICT_REASON = "expect_column_values_to_be_unique(event_id)"  # the gate's reason for a reused id


def _row(event: Event) -> tuple:
    """``astuple`` without its per-field deepcopy (a quarter of the log's time at 2,000 events/s)."""
    return tuple(getattr(event, c) for c in COLUMNS)


def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")  # a commit is on disk before the event is acknowledged
    conn.executescript(SCHEMA)
    return conn


class EventLog:
    def __init__(self, path: Path):
        self.path = path
        self.conn = connect(path)
        insert_columns = ", ".join((*COLUMNS, "received_us"))
        self._insert = (
            f"INSERT OR IGNORE INTO events ({insert_columns}) VALUES ({', '.join('?' * (len(COLUMNS) + 1))})"
        )
        self._select = f"SELECT {', '.join(COLUMNS)} FROM events WHERE event_id IN "

    def _logged(self, event_ids: set[int], cur: sqlite3.Cursor) -> dict[int, Event]:
        """The logged events among ``event_ids``, by id."""
        ids, found = list(event_ids), {}
        for lo in range(0, len(ids), ID_CHUNK):
            chunk = ids[lo : lo + ID_CHUNK]
            for row in cur.execute(self._select + f"({','.join('?' * len(chunk))})", chunk):
                found[row[0]] = Event(*row)
        return found

    def append(
        self, events: list[Event], quarantined: list[tuple[str, str, str]], now_online: list[int]
    ) -> list[str]:
        """One transaction (one fsync): mark ``now_online`` event ids visible, quarantine ``(reason, detail,
        payload)`` rows, insert ``events``. Returns NEW, DUPLICATE (same event already logged) or CONFLICT (the id is
        logged with other content) per event."""
        received = time.time_ns() // 1000
        rows = [(*_row(e), received) for e in events]
        cur = self.conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            if now_online:
                cur.executemany("UPDATE events SET online = 1 WHERE event_id = ?", [(i,) for i in now_online])
            if quarantined:
                cur.executemany(
                    "INSERT INTO quarantine (received_us, reason, detail, payload) VALUES (?, ?, ?, ?)",
                    [(received, *q) for q in quarantined],
                )
            # One lookup for the ids already logged, then one bulk insert of the rest (this thread is the only
            # writer, so nothing lands between the two); a repeat within the group is its own duplicate.
            logged = self._logged({e.event_id for e in events}, cur)
            status, fresh = [], []
            for event, row in zip(events, rows, strict=True):
                stored = logged.get(event.event_id)
                if stored is None:
                    status.append(NEW)
                    fresh.append(row)
                    logged[event.event_id] = event
                    continue
                status.append(DUPLICATE if stored == event else CONFLICT)
                if stored != event:  # the first copy stays; this one is quarantined like a refused event
                    detail = f"event_id {event.event_id} is already logged with other content"
                    cur.execute(
                        "INSERT INTO quarantine (received_us, reason, detail, payload) VALUES (?, ?, ?, ?)",
                        (received, CONFLICT_REASON, detail, json.dumps(asdict(event))),
                    )
            cur.executemany(self._insert, fresh)
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        return status

    def mark_online(self, event_ids: list[int]) -> None:
        if event_ids:
            with self.conn:
                self.conn.executemany(
                    "UPDATE events SET online = 1 WHERE event_id = ?", [(i,) for i in event_ids]
                )

    def not_online(self) -> list[Event]:
        """Durable events not (known to be) in the online lists yet: merged again at start-up."""
        rows = self.conn.execute(f"SELECT {', '.join(COLUMNS)} FROM events WHERE online = 0 ORDER BY seq")
        return [Event(*row) for row in rows]

    def counts(self) -> dict[str, int]:
        one = self.conn.execute
        return {
            "events": one("SELECT COUNT(*) FROM events").fetchone()[0],
            "not_online": one("SELECT COUNT(*) FROM events WHERE online = 0").fetchone()[0],
            "quarantined": one("SELECT COUNT(*) FROM quarantine").fetchone()[0],
        }

    def quarantined(self) -> list[dict]:
        rows = self.conn.execute("SELECT reason, detail, payload FROM quarantine ORDER BY id")
        return [{"reason": r, "detail": d, "payload": json.loads(p)} for r, d, p in rows]

    def close(self) -> None:
        self.conn.close()
