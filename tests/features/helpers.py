"""Small hand-built raw partitions (exact schema types) so feature tests know every expected value."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from features.schema import SCHEMAS
from gemflow.workspace import Workspace

DAY0 = dt.date(2026, 1, 5)
USERS = (1, 2, 3)
# ad_id -> (advertiser_id, category_id, quality)
ADS = {10: (100, 1, 0.9), 11: (100, 2, 0.5), 12: (101, 3, 0.2), 13: (102, 1, 0.7)}


def ts(day: dt.date, seconds: float) -> pd.Timestamp:
    return pd.Timestamp(dt.datetime.combine(day, dt.time(), tzinfo=dt.UTC)) + pd.Timedelta(seconds=seconds)


def users_frame(day: dt.date) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "user_id": list(USERS),
            "age": [25, 40, 61],
            "gender": ["female", "male", "unknown"],
            "country": [3, 7, 3],
            "signup_ts": [ts(DAY0, -86_400 * 30)] * len(USERS),
        }
    )


def ads_frame(day: dt.date) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "ad_id": list(ADS),
            "advertiser_id": [a for a, _, _ in ADS.values()],
            "category_id": [c for _, c, _ in ADS.values()],
            "categories": [[c] for _, c, _ in ADS.values()],
            "quality": [q for _, _, q in ADS.values()],
            "created_ts": [ts(DAY0, -86_400 * 60)] * len(ADS),
        }
    )


def events_frame(day: dt.date, n: int = 40, seed: int = 0) -> pd.DataFrame:
    """``n`` events on ``day``: impressions with labels (+ a click event 1 s after each clicked one) and organic
    views, at distinct random seconds; event ids unique across days."""
    rng = np.random.default_rng([seed, day.toordinal()])
    base_id = (day - DAY0).days * 10_000 + 1
    rows = []
    seconds = np.sort(rng.choice(np.arange(600, 86_000, 7), size=n, replace=False))
    for i, sec in enumerate(seconds):
        user = int(rng.choice(USERS))
        ad = int(rng.choice(list(ADS)))
        surface = str(rng.choice(["feed", "reels", "stories"]))
        if rng.random() < 0.7:
            click = int(rng.random() < 0.4)
            conversion = int(click and rng.random() < 0.5)
            rows.append((base_id + 2 * i, user, ad, "impression", surface, ts(day, sec), click, conversion))
            if click:
                rows.append((base_id + 2 * i + 1, user, ad, "click", surface, ts(day, sec + 1), 0, 0))
        else:
            rows.append((base_id + 2 * i, user, ad, "view", surface, ts(day, sec), 0, 0))
    return pd.DataFrame(rows, columns=SCHEMAS["events"].names)


def to_arrow(table: str, df: pd.DataFrame) -> pa.Table:
    return pa.Table.from_pandas(df, schema=SCHEMAS[table], preserve_index=False)


def write_raw(ws: Workspace, day: dt.date, events: pd.DataFrame | None = None) -> dict[str, pd.DataFrame]:
    """Land one day's raw partition (users and ads snapshots + events); returns the frames written."""
    frames = {
        "users": users_frame(day),
        "ads": ads_frame(day),
        "events": events if events is not None else events_frame(day),
    }
    for table, df in frames.items():
        folder = ws.raw(table, day)
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(to_arrow(table, df), folder / "part-00000.parquet")
    return frames


def land_days(ws: Workspace, days: int, start: dt.date = DAY0) -> dict[dt.date, dict[str, pd.DataFrame]]:
    return {start + dt.timedelta(days=k): write_raw(ws, start + dt.timedelta(days=k)) for k in range(days)}


def publish_without_gate(ws: Workspace, frames_by_day: dict, cfg=None) -> None:
    """Write hand-built (already valid) days straight to the offline store and Feast, skipping the gate, so the
    feature-repo tests do not depend on the validation suites."""
    from features.ingest import IngestConfig
    from features.ingestion.offline import derive_features, write_accepted
    from features.ingestion.online import publish_online

    cfg = cfg or IngestConfig()
    for day, frames in sorted(frames_by_day.items()):
        write_accepted(ws, day, frames)
        _, refreshed = derive_features(ws, day, cfg)
        publish_online(ws, day, cfg, refreshed)


def landed_days(ws: Workspace, days: list[dt.date], events_per_day: int):
    """Hand-built days published (``publish_without_gate``) and a training set "vocab" over all of them: the
    vocabulary the models of the refresh and retrieval tests are built on."""
    from features.training_sets import TrainingSetConfig, build_training_set
    from models.training.data import TrainingSet

    frames = {
        d: {"users": users_frame(d), "ads": ads_frame(d), "events": events_frame(d, n=events_per_day)}
        for d in days
    }
    publish_without_gate(ws, frames)
    build_training_set(ws, TrainingSetConfig(name="vocab", start=days[0].isoformat(), end=days[-1].isoformat(),
                                             join_features=False))  # fmt: skip
    return TrainingSet(ws.training("vocab")).vocab


def expected_recent(events: pd.DataFrame, user: int, n: int = 64) -> list[int]:
    mine = events[events.user_id == user].sort_values(["ts", "event_id"])
    return mine.ad_id.tolist()[-n:]


def expected_impressions(events: pd.DataFrame, ad: int) -> tuple[int, int]:
    imp = events[(events.ad_id == ad) & (events.action == "impression")]
    return len(imp), int(imp.click.sum())


def assert_online_values(store, frames_by_day: dict) -> None:
    """Users 1 and 3 read back their recent ads (every day's events) and profile; ad 11 its last day's stats."""
    all_events = pd.concat([f["events"] for f in frames_by_day.values()], ignore_index=True)
    users = store.get_online_features(
        features=["user_recent_events:recent_ad_ids", "user_profile:user_country"],
        entity_rows=[{"user_id": 1}, {"user_id": 3}],
    ).to_dict()
    assert users["recent_ad_ids"] == [expected_recent(all_events, 1), expected_recent(all_events, 3)]
    assert users["user_country"] == [3, 3]
    ads = store.get_online_features(
        features=["ad_stats:impressions_1d", "ad_stats:clicks_1d"], entity_rows=[{"ad_id": 11}]
    ).to_dict()
    last_day = max(frames_by_day)
    assert (ads["impressions_1d"][0], ads["clicks_1d"][0]) == expected_impressions(
        frames_by_day[last_day]["events"], 11
    )
