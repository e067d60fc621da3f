"""``ServiceReader`` reads what Feast's ``get_online_features(...).to_dict()`` reads, on real SQLite and Redis."""

from __future__ import annotations

import pytest
from feast import FeatureService

from features.feature_repo import FeatureStoreConfig
from features.feature_repo.online_read import ServiceReader, UnsupportedForFastRead, online_reader
from features.ingest import IngestConfig
from features.store import open_store
from gemflow.workspace import Workspace
from tests.features.helpers import ADS, USERS
from tests.features.test_online_writes import _publish as publish_days_and_embeddings
from tests.features.test_redis_store import redis_url  # noqa: F401  (the module's private redis-server)

# user 3 has a profile and events but no embedding; 99 and 999 are unknown
READS = {"ranker_serving": ("user_id", [*USERS, 99]), "ad_candidates": ("ad_id", [*ADS, 999])}


def _feast_read(store, service: str, key: str, ids: list[int]) -> dict:
    return store.get_online_features(
        features=store.get_feature_service(service), entity_rows=[{key: i} for i in ids]
    ).to_dict()


def _assert_reads_equal(store) -> None:
    for service, (key, ids) in READS.items():
        fast = ServiceReader(store, service).read(ids)
        assert fast == _feast_read(store, service, key, ids)
        assert list(fast)[0] == key and all(len(column) == len(ids) for column in fast.values())
    one = ServiceReader(store, "ranker_serving").read([1])
    assert one["user_embedding"] == [[0.5, -1.25]] and one["model_version"] == ["user-model/1"]
    assert len(one["recent_ad_ids"][0]) > 0 and one["user_age"][0] is not None
    assert ServiceReader(store, "ranker_serving").read([3])["user_embedding"] == [None]


def test_service_reader_equals_feast_on_sqlite(tmp_path):
    ws, cfg = Workspace(tmp_path / "ws"), IngestConfig()
    publish_days_and_embeddings(ws, cfg)
    _assert_reads_equal(open_store(ws, cfg.feature_store))


@pytest.mark.integration
def test_service_reader_equals_feast_on_redis(tmp_path, redis_url):  # noqa: F811
    cfg = IngestConfig(
        feature_store=FeatureStoreConfig(
            project="gemflow_read", online_store="redis", redis_connection=redis_url
        )
    )
    ws = Workspace(tmp_path / "ws")
    publish_days_and_embeddings(ws, cfg)
    _assert_reads_equal(open_store(ws, cfg.feature_store))


def test_a_service_it_does_not_reproduce_is_refused_by_name_and_read_through_feast(tmp_path, caplog):
    ws, cfg = Workspace(tmp_path / "ws"), IngestConfig()
    publish_days_and_embeddings(ws, cfg)
    store = open_store(ws, cfg.feature_store)
    profile, stats = store.get_feature_view("user_profile"), store.get_feature_view("ad_stats")
    store.apply([
        FeatureService(name="aliased", features=[profile.with_name("profile_again")]),
        FeatureService(name="two_entities", features=[profile, stats]),
    ])  # fmt: skip
    with pytest.raises(UnsupportedForFastRead, match="aliased"):
        ServiceReader(store, "aliased")
    with pytest.raises(UnsupportedForFastRead, match=r"keyed by \['ad', 'user'\]"):
        ServiceReader(store, "two_entities")
    caplog.set_level("INFO", logger="features.feature_repo.online_read")
    columns, _ = online_reader(store, "aliased", "user_id")([1, 99])
    assert columns == _feast_read(store, "aliased", "user_id", [1, 99])
    assert (
        "reading aliased through Feast's get_online_features (view 'user_profile' is aliased" in caplog.text
    )
    online_reader(store, "ranker_serving", "user_id")
    assert "ranker_serving" not in caplog.text  # a ServiceReader reads it


def test_both_readers_give_the_same_columns_and_newest_event_time(tmp_path, monkeypatch):
    """``online_reader`` through a ServiceReader and through Feast (as for a service the reader refuses): the same
    columns and the same newest event time (whole seconds, as Feast's response reports it)."""
    from features.feature_repo import online_read

    ws, cfg = Workspace(tmp_path / "ws"), IngestConfig()
    publish_days_and_embeddings(ws, cfg)
    store = open_store(ws, cfg.feature_store)
    fast = {service: online_reader(store, service, key)(ids) for service, (key, ids) in READS.items()}

    def refuse(*args):
        raise UnsupportedForFastRead("forced")

    monkeypatch.setattr(online_read, "ServiceReader", refuse)
    feast = {service: online_reader(store, service, key)(ids) for service, (key, ids) in READS.items()}
    assert fast == feast
    assert all(newest is not None and newest.microsecond == 0 for _, newest in fast.values())


def test_a_moved_feast_internal_falls_back_to_feasts_read_with_one_warning(tmp_path, monkeypatch, caplog):
    """A Feast upgrade that moves what the reader leans on (``FeatureStore._get_provider``, which Feast's own read
    keeps using) costs speed, not the reads."""
    from features.feature_repo import online_read

    ws, cfg = Workspace(tmp_path / "ws"), IngestConfig()
    publish_days_and_embeddings(ws, cfg)
    store = open_store(ws, cfg.feature_store)

    def moved(*args):
        raise AttributeError("'FeatureStore' object has no attribute '_get_provider'")

    monkeypatch.setattr(online_read, "ServiceReader", moved)
    caplog.set_level("INFO", logger="features.feature_repo.online_read")
    columns, _ = online_reader(store, "ranker_serving", "user_id")([1, 99])
    assert columns == _feast_read(store, "ranker_serving", "user_id", [1, 99])
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "AttributeError" in warnings[0].getMessage()
