"""Stream a landed day's events to the live event path (``serving.events``) at a fixed rate, in time order.

``gemflow land-synthetic --date D --live RATE`` lands D's users and ads snapshots as usual and, instead of moving
the events partition, posts its events to ``POST /v1/events`` at ``RATE`` events/s: the ranker sees each user's
clicks seconds after they are sent, and the collector's export puts them in the raw log for D's ingest. Events
keep their own timestamps (the day's), so the day ingests exactly as a batch landing would.

A 503 (online store away) or a dropped connection is retried with the same batch: the collector counts a repeated
event once. A 422 names events the collector refused; they are counted and reported, not resent.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import httpx
import pyarrow as pa

log = logging.getLogger(__name__)
POSTS_PER_SECOND = 20  # batches per second: the rate sets the batch size (one POST each 50 ms)


def event_json(table: pa.Table) -> list[dict]:
    """Raw-contract events -> the collector's JSON events (``ts`` ISO 8601 UTC)."""
    rows = table.to_pylist()
    for row in rows:
        row["ts"] = row["ts"].isoformat()
    return rows


def stream_events(
    table: pa.Table,
    url: str,
    rate: float,
    token: str | None = None,
    retries: int = 30,
    progress=None,
    on_batch=None,
) -> dict:
    """Post ``table``'s events (sorted by ts, event_id) to ``url``/v1/events at ``rate`` events/s.
    ``on_batch(hi, sent, answered)``: called after each batch's answer: events ``[0, hi)`` of the sorted table are
    answered; ``sent`` / ``answered``: ``time.monotonic()`` of its first POST and of its answer."""
    if rate <= 0:
        raise ValueError(f"--live rate must be positive, got {rate}")
    table = table.sort_by([("ts", "ascending"), ("event_id", "ascending")])
    events = event_json(table)
    batch = max(1, round(rate / POSTS_PER_SECOND))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    totals: Counter = Counter()
    start = time.monotonic()
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        for k, lo in enumerate(range(0, len(events), batch)):
            wait = start + lo / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            body = {"events": events[lo : lo + batch]}
            sent = time.monotonic()
            for attempt in range(retries + 1):
                try:
                    r = client.post("/v1/events", json=body)
                except httpx.TransportError as err:
                    reason = f"{type(err).__name__}"
                else:
                    if r.status_code in (200, 422):
                        reply = r.json()
                        totals["accepted"] += reply["accepted"] - reply["duplicates"]
                        totals["duplicates"] += reply["duplicates"]
                        totals["rejected"] += len(reply.get("rejected", []))
                        break
                    if r.status_code != 503:
                        raise RuntimeError(f"the collector at {url} answered {r.status_code}: {r.text[:500]}")
                    reason = "503"
                totals["retries"] += 1
                if attempt == retries:
                    raise RuntimeError(
                        f"the collector at {url} refused a batch {retries + 1} times ({reason})"
                    )
                time.sleep(min(2.0, 0.1 * 2**attempt))
            if on_batch is not None:
                on_batch(lo + len(body["events"]), sent, time.monotonic())
            if progress is not None and k % POSTS_PER_SECOND == 0:
                progress(lo + len(body["events"]), len(events))
    wall = time.monotonic() - start
    return {"events": len(events), **totals, "seconds": round(wall, 1), "rate": round(len(events) / wall, 1)}
