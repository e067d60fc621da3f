"""The feature store's settings as a dataclass, rendered to ``feature_store.yaml`` under ``ws.feature_repo``.

Embedded default: parquet files under ``ws.offline(...)`` read by Feast's DuckDB offline store (point-in-time
joins with ``filter_by_created_timestamp``, no server), a SQLite online store and a file registry, all inside the
workspace. ``online_store: redis`` swaps in Redis with the same definitions.

On a cluster every pod that touches Feast mounts the chart's ``feature_store.yaml`` (Redis online store, SQL
registry on Postgres) and names it in ``$GEMFLOW_FEATURE_STORE_YAML``. Its project, registry and online store then
replace the embedded ones, so the stage pods, the training job, the ranker and the Feast feature server all share
one store. The offline store stays the workspace's parquet files. ``${VAR}`` references (passwords) are copied
unexpanded: Feast expands them from the environment when it loads the file, so no secret lands on the workspace
volume.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from gemflow.workspace import Workspace

ONLINE_STORES = ("sqlite", "redis")
FEATURE_STORE_YAML_ENV = "GEMFLOW_FEATURE_STORE_YAML"
# What a mounted feature_store.yaml decides; the offline store (the workspace's parquet) stays ours.
MOUNTED_KEYS = ("project", "registry", "online_store", "entity_key_serialization_version")


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


def mounted_feature_store() -> dict | None:
    """The project, registry and online store of the ``feature_store.yaml`` named by
    ``$GEMFLOW_FEATURE_STORE_YAML``; None when the variable is unset (the laptop default)."""
    where = os.environ.get(FEATURE_STORE_YAML_ENV, "")
    if not where:
        return None
    name = f"{FEATURE_STORE_YAML_ENV}={where}"
    if not Path(where).is_file():
        raise FileNotFoundError(f"{name}: no such file (is the Feast ConfigMap mounted?)")
    try:
        doc = yaml.safe_load(Path(where).read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{name}: not valid YAML: {err}") from err
    if not isinstance(doc, dict) or not {"project", "registry", "online_store"} <= doc.keys():
        raise ValueError(f"{name}: a feature_store.yaml needs project, registry and online_store")
    for key in ("registry", "online_store"):
        section = doc[key]
        path = str(section.get("path") or "") if isinstance(section, dict) else str(section)
        # A relative path would resolve against the workspace's feature repo, not against the mount.
        if path and "://" not in path and not Path(path).is_absolute():
            raise ValueError(f"{name}: {key} path {path!r} must be absolute or a URL")
    return {k: doc[k] for k in MOUNTED_KEYS if k in doc}


def render_feature_store_yaml(ws: Workspace, cfg: FeatureStoreConfig) -> Path:
    """Write ``feature_store.yaml`` for this workspace; returns the repo folder (absolute paths only).

    A mounted cluster ``feature_store.yaml`` (see ``mounted_feature_store``) overrides the project, registry and
    online store of ``cfg``."""
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
    doc.update(mounted_feature_store() or {})
    text = yaml.safe_dump(doc, sort_keys=False)
    path = repo / "feature_store.yaml"
    # Rewrite only on change so the file (and its mtime) is stable across idempotent runs.
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return repo
