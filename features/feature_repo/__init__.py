"""The Feast feature repo of gemflow: definitions built for a workspace, and ``feature_store.yaml`` rendering.

Apply it programmatically with ``features.store.open_store(ws, cfg, apply=True)``; nothing here depends on the
current working directory.
"""

from features.feature_repo.config import FeatureStoreConfig, render_feature_store_yaml
from features.feature_repo.definitions import (
    RECENT_EVENTS_PUSH,
    USER_EMBEDDING_PUSH,
    Definitions,
    build_definitions,
)
from features.feature_repo.tables import FEATURE_TABLES

__all__ = [
    "FEATURE_TABLES",
    "RECENT_EVENTS_PUSH",
    "USER_EMBEDDING_PUSH",
    "Definitions",
    "FeatureStoreConfig",
    "build_definitions",
    "render_feature_store_yaml",
]
