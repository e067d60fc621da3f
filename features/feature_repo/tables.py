"""The offline feature tables ingestion writes (one parquet file per day partition) and Feast reads.

Every table carries ``event_timestamp`` (when the row became true: the "as of" time) and ``created_timestamp``
(when it could first be known). Both are tz-aware UTC. Derived per-day rows are stamped with the partition's end
(``D+1 00:00``): they summarise events strictly before it, so a point-in-time join never sees a later event.

    user_profile        user_id, user_age, user_gender (GENDERS id), user_country
    ad_attributes       ad_id, ad_advertiser_id, ad_category_id, ad_quality
    ad_stats            ad_id, {impressions,clicks,conversions,ctr,cvr}_{1,7,28}d
    ad_serving          ad_id, ad_paused, ad_surfaces (bit i: may show on SURFACES[i]): where an ad may be
                        served, read by retrieval's eligibility filter; not a Feast view (the ranker's dense
                        features are every numeric column of its views, and these are not features)
    user_recent_events  user_id, the last ONLINE_LIST_EVENTS events in time order (oldest first):
                        recent_ad_ids, recent_actions, recent_category_ids, recent_ts (int64 seconds),
                        recent_time_gaps (float32 seconds from each event to the row's event_timestamp),
                        recent_surfaces (SURFACES ids), recent_advertiser_ids, and each event's identity
                        for exact merges (``features.recent_events``): recent_event_ids, recent_ts_us
    user_embedding      user_id, user_embedding (list<float32>), model_version; written by the embedding refresh
                        stage at ``ws.offline("user_embedding", D)/<anything>.parquet``
"""

from __future__ import annotations

import pyarrow as pa

from features.schema import TS

EVENT_TS = "event_timestamp"
CREATED_TS = "created_timestamp"

STATS_WINDOWS: tuple[int, ...] = (1, 7, 28)
STATS_KINDS: tuple[str, ...] = ("impressions", "clicks", "conversions", "ctr", "cvr")


def stats_column(kind: str, days: int) -> str:
    return f"{kind}_{days}d"


def _stamps() -> list[pa.Field]:
    return [pa.field(EVENT_TS, TS, nullable=False), pa.field(CREATED_TS, TS, nullable=False)]


USER_PROFILE = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("user_age", pa.int64(), nullable=False),
        pa.field("user_gender", pa.int64(), nullable=False),
        pa.field("user_country", pa.int64(), nullable=False),
        *_stamps(),
    ]
)

AD_ATTRIBUTES = pa.schema(
    [
        pa.field("ad_id", pa.int64(), nullable=False),
        pa.field("ad_advertiser_id", pa.int64(), nullable=False),
        pa.field("ad_category_id", pa.int64(), nullable=False),
        pa.field("ad_quality", pa.float32(), nullable=False),
        *_stamps(),
    ]
)

AD_SERVING = pa.schema(
    [
        pa.field("ad_id", pa.int64(), nullable=False),
        pa.field("ad_paused", pa.bool_(), nullable=False),
        pa.field("ad_surfaces", pa.int64(), nullable=False),
        *_stamps(),
    ]
)

AD_STATS = pa.schema(
    [pa.field("ad_id", pa.int64(), nullable=False)]
    + [
        pa.field(
            stats_column(kind, days), pa.float32() if kind in ("ctr", "cvr") else pa.int64(), nullable=False
        )
        for days in STATS_WINDOWS
        for kind in STATS_KINDS
    ]
    + _stamps()
)

USER_RECENT_EVENTS = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("recent_ad_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("recent_actions", pa.list_(pa.int64()), nullable=False),
        pa.field("recent_category_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("recent_ts", pa.list_(pa.int64()), nullable=False),
        pa.field("recent_time_gaps", pa.list_(pa.float32()), nullable=False),
        pa.field("recent_surfaces", pa.list_(pa.int64()), nullable=False),
        pa.field("recent_advertiser_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("recent_event_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("recent_ts_us", pa.list_(pa.int64()), nullable=False),
        *_stamps(),
    ]
)

USER_EMBEDDING = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("user_embedding", pa.list_(pa.float32()), nullable=False),
        pa.field("model_version", pa.string(), nullable=False),
        *_stamps(),
    ]
)

FEATURE_TABLES: dict[str, pa.Schema] = {
    "user_profile": USER_PROFILE,
    "ad_attributes": AD_ATTRIBUTES,
    "ad_stats": AD_STATS,
    "ad_serving": AD_SERVING,
    "user_recent_events": USER_RECENT_EVENTS,
    "user_embedding": USER_EMBEDDING,
}
