"""A mounted cluster feature_store.yaml ($GEMFLOW_FEATURE_STORE_YAML) replaces the workspace's registry and online
store: stage writes land in the shared SQL registry and Redis, and a store opened from the mounted file alone (what
the Feast feature server does) reads them back."""

from __future__ import annotations

import datetime as dt

import pytest
import redis
import yaml
from feast import FeatureStore

from features.feature_repo.config import FEATURE_STORE_YAML_ENV, FeatureStoreConfig, render_feature_store_yaml
from features.ingest import IngestConfig
from features.store import open_store
from tests.features.helpers import (
    DAY0,
    ads_frame,
    assert_online_values,
    events_frame,
    publish_without_gate,
    users_frame,
)
from tests.features.test_redis_store import redis_url  # noqa: F401 (a private redis-server per module)

DAYS = (DAY0, DAY0 + dt.timedelta(days=1))


def _write_cluster_yaml(folder, registry, online_store) -> str:
    """A feature_store.yaml shaped like the chart's ConfigMap (helm/gemflow/templates/feast.yaml)."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = {
        "project": "gemflow",
        "provider": "local",
        "registry": registry,
        "online_store": online_store,
        "offline_store": {"type": "duckdb"},
        "entity_key_serialization_version": 3,
    }
    path = folder / "feature_store.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def test_without_the_variable_the_laptop_default_is_unchanged(workspace, monkeypatch):
    monkeypatch.delenv(FEATURE_STORE_YAML_ENV, raising=False)
    repo = render_feature_store_yaml(workspace, FeatureStoreConfig())
    doc = yaml.safe_load((repo / "feature_store.yaml").read_text())
    assert doc["registry"]["registry_type"] == "file"
    assert doc["registry"]["path"] == str(repo / "registry.db")
    assert doc["online_store"] == {"type": "sqlite", "path": str(repo / "online_store.db")}


def test_the_mounted_file_replaces_registry_and_online_store_but_not_the_offline_store(
    workspace, tmp_path, monkeypatch
):
    registry = {
        "registry_type": "sql",
        "path": "postgresql+psycopg://${DB_USER}:${DB_PASSWORD}@pg:5432/feast",
    }
    online = {"type": "redis", "connection_string": "redis:6379,password=${REDIS_PASSWORD}"}
    mounted = _write_cluster_yaml(tmp_path / "mount", registry, online)
    monkeypatch.setenv(FEATURE_STORE_YAML_ENV, mounted)
    monkeypatch.setenv("REDIS_PASSWORD", "r3d1s")
    repo = render_feature_store_yaml(workspace, FeatureStoreConfig(online_store="sqlite"))
    text = (repo / "feature_store.yaml").read_text()
    assert "r3d1s" not in text, "secrets stay ${VAR} references on the shared workspace volume"
    doc = yaml.safe_load(text)
    assert doc["registry"] == registry and doc["online_store"] == online
    assert doc["offline_store"] == {"type": "duckdb"}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("project: [unclosed", "not valid YAML"),
        ("project: gemflow\nregistry: sqlite:///x.db\n", "needs project, registry and online_store"),
        (
            "project: gemflow\nregistry: data/registry.db\nonline_store: {type: redis}\n",
            "registry path 'data/registry.db' must be absolute or a URL",
        ),
    ],
)
def test_a_bad_mounted_file_is_a_named_error(workspace, tmp_path, monkeypatch, content, message):
    path = tmp_path / "feature_store.yaml"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(FEATURE_STORE_YAML_ENV, str(path))
    with pytest.raises((FileNotFoundError, ValueError), match=message) as err:
        open_store(workspace)
    assert FEATURE_STORE_YAML_ENV in str(err.value)


@pytest.mark.integration
def test_stage_writes_land_in_the_mounted_store_and_the_feature_server_view_reads_them(
    workspace,
    tmp_path,
    monkeypatch,
    redis_url,  # noqa: F811
):
    host, port = redis_url.split(":")
    registry_db = tmp_path / "shared" / "registry.db"
    registry_db.parent.mkdir()
    mount = tmp_path / "etc-gemflow-feast"
    mounted = _write_cluster_yaml(
        mount,
        {"registry_type": "sql", "path": f"sqlite:///{registry_db}", "cache_ttl_seconds": 60},
        # The chart writes the password as ${REDIS_PASSWORD}; here the whole address comes from the env.
        {"type": "redis", "connection_string": "${GEMFLOW_TEST_REDIS}"},
    )
    monkeypatch.setenv(FEATURE_STORE_YAML_ENV, mounted)
    monkeypatch.setenv("GEMFLOW_TEST_REDIS", redis_url)

    # The stage code runs with its default (laptop) config: only the mounted file says where the store is.
    frames = {d: {"users": users_frame(d), "ads": ads_frame(d), "events": events_frame(d)} for d in DAYS}
    publish_without_gate(workspace, frames, IngestConfig())
    stage_store = open_store(workspace)
    assert stage_store.config.online_store.type == "redis"
    assert stage_store.config.registry.registry_type == "sql"
    assert not (workspace.feature_repo / "online_store.db").exists()
    assert not (workspace.feature_repo / "registry.db").exists()
    assert registry_db.stat().st_size > 0
    assert redis.Redis(host=host, port=int(port)).dbsize() > 0

    # A store built from the mounted file alone, like `feast serve` in the feature-server pod.
    server_view = FeatureStore(repo_path=str(mount), fs_yaml_file=mount / "feature_store.yaml")
    assert {v.name for v in server_view.list_feature_views()} >= {"user_recent_events", "ad_stats"}
    for store in (stage_store, server_view):
        assert_online_values(store, frames)
