"""Derived feature tables of one day partition, computed from accepted offline data "as of" the day's end.

Everything is a pure function of the accepted rows handed in (no state carried between runs), so a day's tables
come out the same whatever order the dates were ingested in. Derived rows are stamped with the partition's end
(``D+1 00:00`` UTC): they summarise only events strictly before it.
"""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pyarrow as pa

from features import recent_events
from features.feature_repo.offline import day_end, day_start, read_days
from features.feature_repo.tables import (
    AD_ATTRIBUTES,
    AD_SERVING,
    AD_STATS,
    CREATED_TS,
    EVENT_TS,
    STATS_WINDOWS,
    USER_PROFILE,
    stats_column,
)
from features.schema import ACTION_ID, ACTIONS, GENDERS, ONLINE_LIST_EVENTS, SURFACE_ID, SURFACES
from gemflow.workspace import Workspace

EPOCH = pd.Timestamp("1970-01-01", tz="UTC")
TS_DTYPE = pd.DatetimeTZDtype("us", "UTC")


def micros(ts: pd.Series) -> np.ndarray:
    """tz-aware timestamps -> int64 microseconds since the epoch (unit-safe, vectorized)."""
    return ((ts - EPOCH) // pd.Timedelta(microseconds=1)).to_numpy(np.int64)


def vocab_ids(values: pd.Series, vocabulary: tuple[str, ...], what: str) -> np.ndarray:
    codes = pd.Categorical(values, categories=vocabulary).codes.astype(np.int64)
    if (codes < 0).any():
        bad = sorted(set(values[codes < 0].astype(str)))[:5]
        raise ValueError(f"{what}: value(s) outside the vocabulary {vocabulary}: {bad}")
    return codes


def action_ids(values: pd.Series) -> np.ndarray:
    return vocab_ids(values, ACTIONS, "action")


def surface_ids(values: pd.Series) -> np.ndarray:
    return vocab_ids(values, SURFACES, "surface")


def _stamped(frame: dict, stamps, schema: pa.Schema) -> pa.Table:
    """Add event/created timestamps (equal: a derived row is known as soon as it is true)."""
    df = pd.DataFrame(frame)
    df[EVENT_TS] = pd.array(stamps, dtype=TS_DTYPE)
    df[CREATED_TS] = df[EVENT_TS]
    return pa.Table.from_pandas(df, schema=schema, preserve_index=False)


def user_profile_table(users: pd.DataFrame, day: dt.date) -> pa.Table:
    """The day's user snapshot; a row is valid from the day's start (or the signup, if later that day)."""
    users = users.sort_values("user_id", kind="stable")
    stamps = users["signup_ts"].clip(lower=day_start(day))
    frame = {
        "user_id": users["user_id"].to_numpy(np.int64),
        "user_age": users["age"].to_numpy(np.int64),
        "user_gender": vocab_ids(users["gender"], GENDERS, "gender"),
        "user_country": users["country"].to_numpy(np.int64),
    }
    return _stamped(frame, stamps.array, USER_PROFILE)


def ad_attributes_table(ads: pd.DataFrame, day: dt.date) -> pa.Table:
    """The day's ad snapshot; a row is valid from the day's start (or the ad's creation, if later that day)."""
    ads = ads.sort_values("ad_id", kind="stable")
    stamps = ads["created_ts"].clip(lower=day_start(day))
    frame = {
        "ad_id": ads["ad_id"].to_numpy(np.int64),
        "ad_advertiser_id": ads["advertiser_id"].to_numpy(np.int64),
        "ad_category_id": ads["category_id"].to_numpy(np.int64),
        "ad_quality": ads["quality"].to_numpy(np.float32),
    }
    return _stamped(frame, stamps.array, AD_ATTRIBUTES)


def ad_serving_table(ads: pd.DataFrame, day: dt.date) -> pa.Table:
    """Where each ad may be served: ``paused`` (bool) and ``surfaces`` (a list of SURFACES names) when the ads
    source carries them; an ad without them is live on every surface."""
    ads = ads.sort_values("ad_id", kind="stable")
    stamps = ads["created_ts"].clip(lower=day_start(day))
    every = (1 << len(SURFACES)) - 1
    paused = ads["paused"].fillna(False).to_numpy(bool) if "paused" in ads else np.zeros(len(ads), bool)
    if "surfaces" in ads:
        bits = [every if s is None else sum(1 << SURFACE_ID[x] for x in s) for s in ads["surfaces"]]
        surfaces = np.asarray(bits, np.int64)
    else:
        surfaces = np.full(len(ads), every, np.int64)
    frame = {"ad_id": ads["ad_id"].to_numpy(np.int64), "ad_paused": paused, "ad_surfaces": surfaces}
    return _stamped(frame, stamps.array, AD_SERVING)


def ad_stats_table(events: pd.DataFrame, ad_ids: np.ndarray, day: dt.date) -> pa.Table:
    """Rolling impression / click / conversion counts and CTR, CVR (conversions per click) over STATS_WINDOWS.

    ``events``: ``read_events`` of the days ``[day - max window + 1, day]``. One row per ad of the day's snapshot plus any ad shown in the window (zero counts are real).
    """
    impressions = events[events["action"] == ACTION_ID["impression"]]
    ids = np.union1d(np.asarray(ad_ids, np.int64), impressions["ad_id"].to_numpy(np.int64))
    row = np.searchsorted(ids, impressions["ad_id"].to_numpy(np.int64))
    age_days = day.toordinal() - impressions["day"].to_numpy(np.int64)
    clicks = impressions["click"].to_numpy(np.float64)
    conversions = impressions["conversion"].to_numpy(np.float64)
    frame: dict[str, np.ndarray] = {"ad_id": ids}
    for days in STATS_WINDOWS:
        inside = (age_days >= 0) & (age_days < days)
        n_imp = np.bincount(row[inside], minlength=len(ids)).astype(np.int64)
        n_click = np.bincount(row[inside], weights=clicks[inside], minlength=len(ids)).astype(np.int64)
        n_conv = np.bincount(row[inside], weights=conversions[inside], minlength=len(ids)).astype(np.int64)
        frame[stats_column("impressions", days)] = n_imp
        frame[stats_column("clicks", days)] = n_click
        frame[stats_column("conversions", days)] = n_conv
        frame[stats_column("ctr", days)] = (n_click / np.maximum(n_imp, 1)).astype(np.float32)
        frame[stats_column("cvr", days)] = (n_conv / np.maximum(n_click, 1)).astype(np.float32)
    return _stamped(frame, pd.DatetimeIndex([day_end(day)]).repeat(len(ids)).array, AD_STATS)


def recent_events_table(events: pd.DataFrame, day: dt.date, n: int = ONLINE_LIST_EVENTS) -> pa.Table:
    """The last ``n`` events (oldest first) of every user active on ``day``, as of the day's end.

    ``events``: ``read_events`` of a look-back window ending at ``day``. The list is ``features.recent_events``'s
    merge of the window's events: the same code the online writers merge with."""
    active = events["day"] == day.toordinal()
    users_today = np.unique(events.loc[active, "user_id"].to_numpy(np.int64))
    mine = events[events["user_id"].isin(users_today)]
    merged = recent_events.merge(recent_events.empty_events(), mine, n)
    return recent_events.view_rows(merged, int(micros(pd.Series([day_end(day)]))[0]))


def read_events(ws: Workspace, days: list[dt.date]) -> pd.DataFrame:
    """Accepted events of ``days`` (in (ts, event_id) order) with their ad's attributes from the same day's
    accepted ads snapshot; ``action``/``surface`` as vocabulary ids, ``ts_us`` in microseconds, ``day`` ordinal."""
    events = read_days(
        ws, "events", days, ["event_id", "user_id", "ad_id", "action", "surface", "ts", "click", "conversion"]
    )
    ads = read_days(ws, "ads", days, ["ad_id", "advertiser_id", "category_id", "quality"])
    joined = events.merge(ads, on=["day", "ad_id"], how="left", validate="many_to_one")
    unknown = joined["advertiser_id"].isna()
    if unknown.any():
        raise ValueError(
            f"{int(unknown.sum())} accepted event(s) reference ads missing from their day's ads "
            f"snapshot, e.g. ad_id {joined.loc[unknown, 'ad_id'].head().tolist()}"
        )
    joined["advertiser_id"] = joined["advertiser_id"].astype(np.int64)
    joined["category_id"] = joined["category_id"].astype(np.int64)
    joined["action"] = action_ids(joined["action"])
    joined["surface"] = surface_ids(joined["surface"])
    joined["ts_us"] = micros(joined["ts"])
    return joined
