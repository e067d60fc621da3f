"""The platform's raw event-log contract: every source (synthetic, MovieLens, generic importer) writes these.

Three tables land per day partition: ``events`` (one row per user action), and snapshots of ``users`` and
``ads``. Timestamps are timezone-aware UTC (microseconds). Ids are int64. Enumerations are small string
vocabularies whose integer codes (the position in the tuple) are the ids the models embed.
"""

from __future__ import annotations

import pyarrow as pa

# Paid actions first, then organic ones. An impression carries the labels of what followed it.
ACTIONS: tuple[str, ...] = (
    "impression",
    "click",
    "conversion",
    "view",
    "like",
    "share",
    "comment",
    "hide",
)
SURFACES: tuple[str, ...] = ("feed", "stories", "reels", "search", "marketplace")
GENDERS: tuple[str, ...] = ("unknown", "female", "male")

ACTION_ID = {name: i for i, name in enumerate(ACTIONS)}
SURFACE_ID = {name: i for i, name in enumerate(SURFACES)}

TS = pa.timestamp("us", tz="UTC")

# events: labels (click, conversion) are 0/1 on impressions and 0 on every other action;
# conversion implies click. ``ad_id`` must exist in the ads table (organic actions touch ads too).
EVENTS_SCHEMA = pa.schema(
    [
        pa.field("event_id", pa.int64(), nullable=False),
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("ad_id", pa.int64(), nullable=False),
        pa.field("action", pa.string(), nullable=False),
        pa.field("surface", pa.string(), nullable=False),
        pa.field("ts", TS, nullable=False),
        pa.field("click", pa.int8(), nullable=False),
        pa.field("conversion", pa.int8(), nullable=False),
    ]
)

USERS_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("age", pa.int16(), nullable=False),  # years, 13..100
        pa.field("gender", pa.string(), nullable=False),  # one of GENDERS
        pa.field("country", pa.int32(), nullable=False),  # categorical id (occupation for MovieLens)
        pa.field("signup_ts", TS, nullable=False),
    ]
)

# ``categories`` holds every attribute of the item (MovieLens: all genres); ``category_id`` is the primary one.
ADS_SCHEMA = pa.schema(
    [
        pa.field("ad_id", pa.int64(), nullable=False),
        pa.field("advertiser_id", pa.int64(), nullable=False),
        pa.field("category_id", pa.int32(), nullable=False),
        pa.field("categories", pa.list_(pa.int32()), nullable=False),
        pa.field("quality", pa.float32(), nullable=False),  # 0..1
        pa.field("created_ts", TS, nullable=False),
    ]
)

SCHEMAS: dict[str, pa.Schema] = {"events": EVENTS_SCHEMA, "users": USERS_SCHEMA, "ads": ADS_SCHEMA}

# Fields of one history event as the models read it (jagged per user, sorted by ts).
HISTORY_FIELDS: tuple[str, ...] = ("ad_id", "action", "surface", "category_id", "advertiser_id", "ts")
# Length of each user's recent-events list in the online store (``user_recent_events``). Longer than the ranker's
# window (``ranker.recent_events``, 64): events newer than the ranker's fresh cutoff already sit in the list when it
# is read and serving skips them, so the list needs room for what a user does within the push delay
# (docs/train-serve.md: with lists of 64 most live-day rows were cut short, with 128 none).
ONLINE_LIST_EVENTS = 128

# Defect classes the generator can inject and the validation gate must catch (one reason each).
DEFECTS: tuple[str, ...] = (
    "null_field",  # a required field is null
    "bad_type",  # a value that does not parse as the column's type
    "out_of_range",  # a negative id, or an age / quality outside its range
    "bad_enum",  # an action or surface outside the vocabulary
    "future_ts",  # timestamp after the ingestion's wall clock
    "outside_window",  # timestamp outside the logical date's partition
    "duplicate_event_id",
    "label_action_mismatch",  # labels on a non-impression, or conversion without click
    "unknown_ad",  # the ad does not exist in the ads table (referential integrity)
    "volume_drop",  # the partition is far smaller than the previous one
)
