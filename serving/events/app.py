"""The event collector's HTTP service (``gemflow events serve``): ``POST /v1/events`` (one event or a batch),
``/health/live``, ``/health/ready``, ``/metrics``.

Answers (errors in the serving endpoint's shape, ``{"error": ...}``):
- 200 ``{"accepted", "duplicates"}``: every event is durable and in its user's online list (a repeat of an
  event already logged counts once and is acknowledged again);
- 422: some events broke the raw-log contract; each is named (``rejected``: index, event_id, reason, detail) and
  quarantined, the valid events of the batch are accepted as for a 200 (``accepted``);
- 400 malformed JSON, 401 missing/wrong bearer token, 413 body or batch too large;
- 503 + ``Retry-After``: not acknowledged (the online store is down, or too many users wait for it); events of the
  request that were logged become visible when the store returns, and a retry is counted once.

Safe by default like the ranker: binds 127.0.0.1; with ``GEMFLOW_EVENTS_TOKEN`` set, ``POST /v1/events`` needs
``Authorization: Bearer <token>`` (probes and ``/metrics`` stay open).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from serving.auth import bearer_ok
from serving.events.ads import AdLookup
from serving.events.config import EventsConfig
from serving.events.export import Exporter
from serving.events.log import CONFLICT, CONFLICT_REASON, DUPLICATE, EventLog
from serving.events.validate import Refused, check_event
from serving.events.writer import Writer

log = logging.getLogger(__name__)
TOKEN_ENV = "GEMFLOW_EVENTS_TOKEN"


def log_path(cfg: EventsConfig, ws) -> Path:
    return Path(cfg.log_path) if cfg.log_path else ws.root / "events" / "events.db"


@dataclass
class Collector:
    """What one collector process runs: the log, the writer thread, the exporter, the ad lookup."""

    cfg: EventsConfig
    log: EventLog
    writer: Writer
    exporter: Exporter
    ads: AdLookup
    token: str | None
    counts: dict[str, int]

    def start(self) -> None:
        self.writer.start()
        self.exporter.start()

    def stop(self) -> None:
        self.writer.stop()
        self.exporter.stop()
        self.log.close()


def build_collector(cfg: EventsConfig, ws, env: dict[str, str] | None = None) -> Collector:
    from features.feature_repo import RECENT_EVENTS_PUSH
    from features.feature_repo.online import push_views
    from features.feature_repo.online_read import sqlite_connection
    from features.list_cache import ListCache
    from features.recent_events import LIST_COLUMNS, merge_online
    from features.store import open_store

    store = open_store(ws, cfg.feature_store, apply=True)
    views = push_views(store, RECENT_EVENTS_PUSH)  # resolved once: a registry lookup per write cost ~9 ms
    online_db = sqlite_connection(store)
    if online_db is not None:
        # The embedded SQLite online store: WAL, so a write neither waits for nor blocks the ranker's reads, and
        # one fsync per commit at most (NORMAL): the durable copy of every event is the event log, and a list lost
        # to a power cut is rebuilt by that day's ingest. (Persistent: Feast's other connections get WAL too.)
        online_db.execute("PRAGMA journal_mode=WAL")
        online_db.execute("PRAGMA synchronous=NORMAL")
    n = cfg.recent_events
    # the lists this collector wrote, checked against the store's bytes before each merge (features.list_cache)
    view = next(v for v in views if v.name == "user_recent_events")
    cache = ListCache.of(store, view, LIST_COLUMNS)

    def push(events, as_of):
        return merge_online(store, events, n, as_of, views=views, cache=cache)

    path = log_path(cfg, ws)
    event_log = EventLog(path)
    writer = Writer(event_log, push, cfg.group_window_ms / 1000, cfg.max_group_events, cfg.retry_online_s)
    env = os.environ if env is None else env
    counts = dict.fromkeys(("requests", "accepted", "duplicates", "rejected", "unavailable"), 0)
    return Collector(
        cfg=cfg,
        log=event_log,
        writer=writer,
        exporter=Exporter(path, ws, cfg.export_every_s),
        ads=AdLookup(ws, cfg.ads_reload_s),
        token=env.get(TOKEN_ENV) or None,
        counts=counts,
    )


def _json(status: int, body: dict, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(body), status, headers=headers, media_type="application/json")


def _error(status: int, message: str, **extra) -> Response:
    headers = {"Retry-After": "1"} if status == 503 else None
    return _json(status, {"error": message, **extra}, headers)


async def _body(request: Request, limit: int) -> bytes | None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(collector: Collector) -> Starlette:
    limits = collector.cfg.limits
    counts = collector.counts

    async def post_events(request: Request) -> Response:
        counts["requests"] += 1
        headers = {k.lower().encode(): v.encode() for k, v in request.headers.items()}
        if not bearer_ok(headers, collector.token):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        body = await _body(request, limits.max_body_bytes)
        if body is None:
            return _error(413, f"request body larger than {limits.max_body_bytes} bytes")
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as err:
            return _error(400, f"malformed JSON: {err}")
        if isinstance(payload, dict) and "events" in payload:
            raw = payload["events"]
            if not isinstance(raw, list):
                return _error(400, '"events" must be a list of event objects')
        elif isinstance(payload, dict):
            raw = [payload]
        else:
            return _error(400, 'the body must be one event object or {"events": [...]}')
        if len(raw) > limits.max_batch_events:
            return _error(413, f"{len(raw)} events in one request; at most {limits.max_batch_events}")
        if len(collector.writer.pending) > limits.max_pending_users:
            counts["unavailable"] += 1
            return _error(503, "the online store is not keeping up: too many users wait for it; retry later")
        now = dt.datetime.now(dt.UTC)
        events, kept_index, rejected, quarantined = [], [], [], []
        for i, item in enumerate(raw):
            try:
                events.append(check_event(item, collector.ads, now, limits.clock_skew_s, limits.max_age_days))
                kept_index.append(i)
            except Refused as why:
                event_id = item.get("event_id") if isinstance(item, dict) else None
                rejected.append(
                    {"index": i, "event_id": event_id, "reason": why.reason, "detail": why.detail}
                )
                quarantined.append((why.reason, why.detail, orjson.dumps(item).decode()))
        future = collector.writer.submit(events, quarantined)
        try:
            outcome = await asyncio.wrap_future(future)
        except Exception as err:  # noqa: BLE001  the durable log failed: nothing is acknowledged
            counts["unavailable"] += 1
            return _error(503, f"the event log could not commit ({type(err).__name__}); retry later")
        for index, event, status in zip(kept_index, events, outcome.status, strict=True):
            if status == CONFLICT:
                detail = f"event_id {event.event_id} is already logged with other content"
                rejected.append({"index": index, "event_id": event.event_id, "reason": CONFLICT_REASON,
                                 "detail": detail})  # fmt: skip
        duplicates = outcome.status.count(DUPLICATE)
        accepted = len(events) - outcome.status.count(CONFLICT)
        counts["rejected"] += len(rejected)
        if not outcome.visible:
            counts["unavailable"] += 1
            return _error(
                503,
                "the online store is unavailable: the events are durable and become visible when it returns; "
                "retrying is safe (a repeat counts once)",
                logged=accepted,
            )
        counts["accepted"] += accepted - duplicates
        counts["duplicates"] += duplicates
        if rejected:
            rejected.sort(key=lambda r: r["index"])
            first = rejected[0]
            return _json(422, {"error": f"{len(rejected)} event(s) refused, e.g. #{first['index']}: "
                                        f"{first['reason']}: {first['detail']}",
                               "accepted": accepted, "duplicates": duplicates, "rejected": rejected})  # fmt: skip
        return _json(200, {"accepted": accepted, "duplicates": duplicates})

    async def live(_: Request) -> Response:
        return _json(200 if collector.writer.alive else 503, {"live": collector.writer.alive})

    async def ready(_: Request) -> Response:
        ok = collector.writer.alive and collector.writer.online_ok
        return _json(200 if ok else 503, {"ready": ok, "online_store": collector.writer.online_ok})

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Metrics(collector))

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return Starlette(
        routes=[
            Route("/v1/events", post_events, methods=["POST"]),
            Route("/health/live", live),
            Route("/health/ready", ready),
            Route("/metrics", metrics),
        ]
    )


class _Metrics:
    """Read at scrape time from the collector's own counts (no second set of counters to keep in step)."""

    def __init__(self, collector: Collector):
        self.c = collector

    def collect(self):
        events = CounterMetricFamily("gemflow_events", "Reported events by outcome", labels=["outcome"])
        for outcome in ("accepted", "duplicates", "rejected"):
            events.add_metric([outcome], self.c.counts[outcome])
        yield events
        yield CounterMetricFamily(
            "gemflow_events_requests", "POST /v1/events requests", value=self.c.counts["requests"]
        )
        yield CounterMetricFamily(
            "gemflow_events_unavailable",
            "Requests answered 503 (not acknowledged)",
            value=self.c.counts["unavailable"],
        )
        w = self.c.writer.counts
        yield CounterMetricFamily(
            "gemflow_events_online_writes", "Merged online writes", value=w["online_writes"]
        )
        yield CounterMetricFamily(
            "gemflow_events_online_failures",
            "Online writes that failed (retried)",
            value=w["online_failures"],
        )
        yield CounterMetricFamily(
            "gemflow_events_exported", "Events exported to the raw log", value=self.c.exporter.exported
        )
        yield GaugeMetricFamily(
            "gemflow_events_pending_users",
            "Users with durable events not yet online",
            value=len(self.c.writer.pending),
        )


def serve(cfg: EventsConfig, ws) -> None:
    """Run the collector until interrupted (SIGINT/SIGTERM: uvicorn drains, then the writer and exporter stop)."""
    import uvicorn

    from serving.connections import uvicorn_settings

    collector = build_collector(cfg, ws)
    collector.start()
    app = create_app(collector)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        access_log=False,
        log_level="info",
        **uvicorn_settings(cfg.connection),
    )
    try:
        uvicorn.Server(config).run()
    finally:
        collector.stop()
