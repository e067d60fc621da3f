"""Feast entities, sources, feature views and services, built for one workspace (no working-directory magic).

``build_definitions(ws, cfg)`` returns every object ``FeatureStore.apply`` needs. Sources are the day-partitioned
parquet tables of ``features.feature_repo.tables`` (a glob over ``ws.offline(table)/date=*/``); each view has a
``created_timestamp_column`` so training joins can drop rows that were not yet known.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from feast import Entity, FeatureService, FeatureView, Field, FileSource, PushSource, ValueType
from feast.types import Array, Float32, Int64, String

from features.feature_repo.config import FeatureStoreConfig
from features.feature_repo.tables import CREATED_TS, EVENT_TS, STATS_KINDS, STATS_WINDOWS, stats_column
from gemflow.workspace import Workspace

RECENT_EVENTS_PUSH = "user_recent_events_push"
USER_EMBEDDING_PUSH = "user_embedding_push"


@dataclass
class Definitions:
    user: Entity
    ad: Entity
    views: dict[str, FeatureView]
    push_sources: dict[str, PushSource]
    services: dict[str, FeatureService]

    def objects(self) -> list:
        return [
            self.user,
            self.ad,
            *self.push_sources.values(),
            *self.views.values(),
            *self.services.values(),
        ]


def source_glob(ws: Workspace, table: str) -> str:
    return str(ws.offline(table) / "date=*" / "*.parquet")


def _file_source(ws: Workspace, table: str) -> FileSource:
    return FileSource(
        name=f"{table}_source",
        path=source_glob(ws, table),
        timestamp_field=EVENT_TS,
        created_timestamp_column=CREATED_TS,
    )


def _ttl(days: int) -> timedelta:
    return timedelta(days=days)  # timedelta(0) means "never expires" in Feast


def build_definitions(ws: Workspace, cfg: FeatureStoreConfig | None = None) -> Definitions:
    cfg = cfg or FeatureStoreConfig()
    user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.INT64, description="A person.")
    ad = Entity(name="ad", join_keys=["ad_id"], value_type=ValueType.INT64, description="An ad (candidate).")

    recent_source = _file_source(ws, "user_recent_events")
    embedding_source = _file_source(ws, "user_embedding")
    push_sources = {
        RECENT_EVENTS_PUSH: PushSource(name=RECENT_EVENTS_PUSH, batch_source=recent_source),
        USER_EMBEDDING_PUSH: PushSource(name=USER_EMBEDDING_PUSH, batch_source=embedding_source),
    }

    user_profile = FeatureView(
        name="user_profile",
        entities=[user],
        ttl=_ttl(cfg.profile_ttl_days),
        schema=[
            Field(name="user_age", dtype=Int64),
            Field(name="user_gender", dtype=Int64),
            Field(name="user_country", dtype=Int64),
        ],
        online=True,
        source=_file_source(ws, "user_profile"),
    )
    ad_attributes = FeatureView(
        name="ad_attributes",
        entities=[ad],
        ttl=_ttl(cfg.profile_ttl_days),
        schema=[
            Field(name="ad_advertiser_id", dtype=Int64),
            Field(name="ad_category_id", dtype=Int64),
            Field(name="ad_quality", dtype=Float32),
        ],
        online=True,
        source=_file_source(ws, "ad_attributes"),
    )
    ad_stats = FeatureView(
        name="ad_stats",
        entities=[ad],
        ttl=_ttl(cfg.ad_stats_ttl_days),
        schema=[
            Field(name=stats_column(kind, days), dtype=Float32 if kind in ("ctr", "cvr") else Int64)
            for days in STATS_WINDOWS
            for kind in STATS_KINDS
        ],
        online=True,
        source=_file_source(ws, "ad_stats"),
    )
    user_recent_events = FeatureView(
        name="user_recent_events",
        entities=[user],
        ttl=_ttl(cfg.recent_events_ttl_days),
        schema=[
            Field(name="recent_ad_ids", dtype=Array(Int64)),
            Field(name="recent_actions", dtype=Array(Int64)),
            Field(name="recent_category_ids", dtype=Array(Int64)),
            Field(name="recent_ts", dtype=Array(Int64)),
            Field(name="recent_time_gaps", dtype=Array(Float32)),
            Field(name="recent_surfaces", dtype=Array(Int64)),
            Field(name="recent_advertiser_ids", dtype=Array(Int64)),
            # identity of each event: live and daily writers merge lists exactly (features.recent_events)
            Field(name="recent_event_ids", dtype=Array(Int64)),
            Field(name="recent_ts_us", dtype=Array(Int64)),
        ],
        online=True,
        source=push_sources[RECENT_EVENTS_PUSH],
    )
    user_embedding = FeatureView(
        name="user_embedding",
        entities=[user],
        ttl=_ttl(cfg.embedding_ttl_days),
        schema=[
            Field(name="user_embedding", dtype=Array(Float32)),
            Field(name="model_version", dtype=String),
        ],
        online=True,
        source=push_sources[USER_EMBEDDING_PUSH],
    )
    views = {v.name: v for v in (user_profile, ad_attributes, ad_stats, user_recent_events, user_embedding)}
    services = {
        # Everything the ranker trains on, joined point in time per impression.
        "ranker_training": FeatureService(
            name="ranker_training",
            features=[ad_stats, ad_attributes, user_profile, user_recent_events, user_embedding],
        ),
        # Per request, serving reads only the user side online; ad features live in an in-process table.
        "ranker_serving": FeatureService(
            name="ranker_serving", features=[user_profile, user_recent_events, user_embedding]
        ),
        "ad_candidates": FeatureService(name="ad_candidates", features=[ad_attributes, ad_stats]),
    }
    return Definitions(user=user, ad=ad, views=views, push_sources=push_sources, services=services)
