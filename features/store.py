"""Opening the workspace's Feast ``FeatureStore`` (embedded SQLite default or Redis) and applying definitions."""

from __future__ import annotations

import logging
import warnings

from feast import FeatureStore

from features.feature_repo import FeatureStoreConfig, build_definitions, render_feature_store_yaml
from gemflow.workspace import Workspace

log = logging.getLogger(__name__)


def open_store(ws: Workspace, cfg: FeatureStoreConfig | None = None, *, apply: bool = False) -> FeatureStore:
    """Render ``feature_store.yaml`` under ``ws.feature_repo`` and open it; ``apply`` registers the definitions."""
    cfg = cfg or FeatureStoreConfig()
    repo = render_feature_store_yaml(ws, cfg)
    store = FeatureStore(repo_path=str(repo))
    if apply:
        apply_definitions(store, ws, cfg)
    return store


def apply_definitions(store: FeatureStore, ws: Workspace, cfg: FeatureStoreConfig) -> None:
    defs = build_definitions(ws, cfg)
    with warnings.catch_warnings():
        # Feast warns about experimental features (push sources, list types) on every apply.
        warnings.simplefilter("ignore", RuntimeWarning)
        store.apply(defs.objects())
    log.info("feast apply: %d views, %d services -> %s", len(defs.views), len(defs.services), store.repo_path)
