"""The Feast repo on the embedded defaults: apply, materialize, push, online and point-in-time reads."""

from __future__ import annotations

import datetime as dt

import pandas as pd
import pytest
import yaml

from features.feature_repo import FeatureStoreConfig, build_definitions
from features.feature_repo.offline import day_end, day_start
from features.schema import ONLINE_LIST_EVENTS, SURFACES
from features.store import open_store
from tests.features.helpers import (
    ADS,
    DAY0,
    ads_frame,
    events_frame,
    expected_impressions,
    expected_recent,
    publish_without_gate,
    users_frame,
)

DAY1 = DAY0 + dt.timedelta(days=1)
ONLINE_REFS = [
    "user_recent_events:recent_ad_ids",
    "user_recent_events:recent_actions",
    "user_recent_events:recent_time_gaps",
    "user_recent_events:recent_surfaces",
    "user_recent_events:recent_advertiser_ids",
    "user_profile:user_age",
]


@pytest.fixture
def frames():
    return {
        d: {"users": users_frame(d), "ads": ads_frame(d), "events": events_frame(d)} for d in (DAY0, DAY1)
    }


def test_rendered_yaml_keeps_everything_inside_the_workspace(workspace):
    store = open_store(workspace)
    doc = yaml.safe_load((workspace.feature_repo / "feature_store.yaml").read_text())
    assert doc["offline_store"]["type"] == "duckdb"
    assert doc["online_store"] == {"type": "sqlite", "path": str(workspace.feature_repo / "online_store.db")}
    assert doc["registry"]["path"].startswith(str(workspace.root))
    assert store.config.entity_key_serialization_version == 3


def test_redis_rendering_and_bad_online_store(workspace):
    open_store(workspace, FeatureStoreConfig(online_store="redis", redis_connection="localhost:6390"))
    doc = yaml.safe_load((workspace.feature_repo / "feature_store.yaml").read_text())
    assert doc["online_store"] == {"type": "redis", "connection_string": "localhost:6390"}
    with pytest.raises(ValueError, match="online_store"):
        FeatureStoreConfig(online_store="dynamo")


def test_definitions_have_created_timestamps_and_services(workspace):
    defs = build_definitions(workspace)
    assert set(defs.views) == {
        "user_profile",
        "ad_attributes",
        "ad_stats",
        "user_recent_events",
        "user_embedding",
    }
    for view in defs.views.values():
        assert view.batch_source.created_timestamp_column == "created_timestamp"
        assert view.batch_source.path.startswith(str(workspace.offline("")))
    training = {p.name for p in defs.services["ranker_training"].feature_view_projections}
    assert training == set(defs.views)
    assert {"ranker_training", "ranker_serving"} <= set(defs.services)


def test_apply_materialize_push_then_online_reads(workspace, frames):
    publish_without_gate(workspace, frames)
    store = open_store(workspace)
    assert {fv.name for fv in store.list_feature_views()} >= {"ad_stats", "user_recent_events"}
    all_events = pd.concat([f["events"] for f in frames.values()], ignore_index=True)

    online = store.get_online_features(
        features=ONLINE_REFS, entity_rows=[{"user_id": 1}, {"user_id": 2}]
    ).to_dict()
    for i, user in enumerate((1, 2)):
        assert online["recent_ad_ids"][i] == expected_recent(all_events, user)
        mine = all_events[all_events.user_id == user].sort_values(["ts", "event_id"]).tail(ONLINE_LIST_EVENTS)
        assert online["recent_surfaces"][i] == [SURFACES.index(s) for s in mine.surface]
        assert online["recent_advertiser_ids"][i] == [ADS[a][0] for a in mine.ad_id]
        gaps = online["recent_time_gaps"][i]
        assert gaps == sorted(gaps, reverse=True) and min(gaps) > 0  # oldest first, all before the as-of time
    assert online["user_age"] == [25, 40]

    stats = store.get_online_features(
        features=[
            "ad_stats:impressions_1d",
            "ad_stats:clicks_1d",
            "ad_stats:impressions_7d",
            "ad_stats:ctr_7d",
        ],
        entity_rows=[{"ad_id": 10}, {"ad_id": 12}],
    ).to_dict()
    for i, ad in enumerate((10, 12)):
        imp_last, clicks_last = expected_impressions(frames[DAY1]["events"], ad)
        imp_all, clicks_all = expected_impressions(all_events, ad)
        assert stats["impressions_1d"][i] == imp_last and stats["clicks_1d"][i] == clicks_last
        assert stats["impressions_7d"][i] == imp_all
        assert stats["ctr_7d"][i] == pytest.approx(clicks_all / max(imp_all, 1), rel=1e-6)


def test_point_in_time_join_sees_only_earlier_days(workspace, frames):
    publish_without_gate(workspace, frames)
    store = open_store(workspace)
    entity = pd.DataFrame(
        {
            "user_id": [1, 1, 1],
            "ad_id": [10, 10, 10],
            "event_timestamp": [day_start(DAY1) - pd.Timedelta(seconds=1), day_start(DAY1), day_end(DAY1)],
        }
    )
    got = (
        store.get_historical_features(
            entity_df=entity,
            features=["ad_stats:impressions_1d", "user_recent_events:recent_ad_ids"],
            filter_by_created_timestamp=True,
        )
        .to_df()
        .sort_values("event_timestamp", ignore_index=True)
    )
    assert pd.isna(got.impressions_1d[0])  # nothing is known before DAY0 ends
    assert got.impressions_1d[1] == expected_impressions(frames[DAY0]["events"], 10)[0]
    assert got.impressions_1d[2] == expected_impressions(frames[DAY1]["events"], 10)[0]
    assert list(got.recent_ad_ids[1]) == expected_recent(frames[DAY0]["events"], 1)
