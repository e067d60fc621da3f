"""The event collector's config (``gemflow events serve``). Secrets are not config: the bearer token comes from
``GEMFLOW_EVENTS_TOKEN`` (``serving.events.app``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from features.feature_repo import FeatureStoreConfig
from features.schema import ONLINE_LIST_EVENTS
from serving.config import ConnectionConfig


@dataclass
class EventLimits:
    max_body_bytes: int = 1_000_000  # a 1,000-event batch is ~180 kB of JSON
    max_batch_events: int = 1000  # events per request
    max_pending_users: int = 100_000  # users durable but not yet visible online; beyond -> 503 (store down)
    clock_skew_s: float = 300.0  # an event's ts may lead the server clock by this (the gate's clock_skew)
    max_age_days: float = 28.0  # older events are refused: the daily ingest of their day is long done


@dataclass
class EventsConfig:
    host: str = "127.0.0.1"  # 0.0.0.0 only inside a pod
    port: int = 8090
    log_path: str = ""  # the durable event log (SQLite); "" = <workspace>/events/events.db
    recent_events: int = ONLINE_LIST_EVENTS  # the online lists' length (the ingest's ``recent_events``)
    # the writer gathers requests this long before one commit (one fsync) + one online write: a write costs ~6 ms
    # of CPU whatever its size, so 20 ms keeps it under a third of a core and well inside the 1 s visibility goal
    group_window_ms: float = 20.0
    max_group_events: int = 5000  # ... or until this many events
    retry_online_s: float = 0.5  # how often users whose online write failed are retried
    export_every_s: float = 5.0  # how often the log is exported into the raw event log (0: never)
    ads_reload_s: float = 5.0  # at most this often, an unknown ad reloads the ads snapshot
    feature_store: FeatureStoreConfig = field(default_factory=FeatureStoreConfig)
    limits: EventLimits = field(default_factory=EventLimits)
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
