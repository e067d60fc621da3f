"""The feature store's settings as a dataclass, rendered to ``feature_store.yaml`` under ``ws.feature_repo``.

Embedded default: parquet files under ``ws.offline(...)`` read by Feast's DuckDB offline store (point-in-time
joins with ``filter_by_created_timestamp``, no server), a SQLite online store and a file registry, all inside the
workspace. ``online_store: redis`` swaps in Redis (the cluster path) with the same definitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from gemflow.workspace import Workspace

ONLINE_STORES = ("sqlite", "redis")


@dataclass
class FeatureStoreConfig:
    project: str = "gemflow"
    online_store: str = "sqlite"  # sqlite | redis
    redis_connection: str = "localhost:6379"  # host:port[,password=...] when online_store is redis
    # How long a row stays valid in point-in-time joins and online reads (0 = forever).
    profile_ttl_days: int = 0
    ad_stats_ttl_days: int = 7
    recent_events_ttl_days: int = 28
    embedding_ttl_days: int = 0

    def __post_init__(self) -> None:
        if self.online_store not in ONLINE_STORES:
            raise ValueError(f"online_store must be one of {ONLINE_STORES}, got {self.online_store!r}")


def render_feature_store_yaml(ws: Workspace, cfg: FeatureStoreConfig) -> Path:
    """Write ``feature_store.yaml`` for this workspace; returns the repo folder (absolute paths only)."""
    repo = ws.feature_repo
    repo.mkdir(parents=True, exist_ok=True)
    if cfg.online_store == "sqlite":
        online = {"type": "sqlite", "path": str(repo / "online_store.db")}
    else:
        online = {"type": "redis", "connection_string": cfg.redis_connection}
    doc = {
        "project": cfg.project,
        "provider": "local",
        "registry": {"registry_type": "file", "path": str(repo / "registry.db"), "cache_ttl_seconds": 60},
        "offline_store": {"type": "duckdb"},
        "online_store": online,
        "entity_key_serialization_version": 3,
    }
    text = yaml.safe_dump(doc, sort_keys=False)
    path = repo / "feature_store.yaml"
    # Rewrite only on change so the file (and its mtime) is stable across idempotent runs.
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return repo
