"""The online publish of an ingestion: ``feast apply``, the batch views materialized, the recent events pushed."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from features import recent_events
from features.feature_repo.offline import day_end, day_start, partition_days, partition_files
from features.feature_repo.tables import EVENT_TS
from features.ingestion import step
from gemflow.workspace import Workspace

log = logging.getLogger("features.ingest")

BATCH_VIEWS = ["user_profile", "ad_attributes", "ad_stats"]  # materialized; recent events are pushed
PUSH_USERS = 100_000  # users merged and pushed at a time: the push holds their lists, never a whole day's


def publish_online(
    ws: Workspace, day: dt.date, cfg, refreshed: list[dt.date], timings: dict[str, float] | None = None
) -> dict:
    """feast apply; materialize the batch views from ``day``'s start to the newest ingested day's end; merge the
    recent events of the ``refreshed`` days (their offline partitions) into the online lists."""
    from features.feature_repo import online as online_writes
    from features.store import open_store

    timings = {} if timings is None else timings
    newest = partition_days(ws, "offline", "events")[-1]
    online: dict = {"materialized": [], "pushed_rows": 0}
    with step("feast apply", timings):
        store = open_store(ws, cfg.feature_store, apply=True)
    fast = cfg.online_writer == "fast"
    if cfg.materialize:
        start, end = day_start(day).to_pydatetime(), day_end(newest).to_pydatetime()
        with step("materialize", timings):
            if fast:
                online_writes.materialize(store, BATCH_VIEWS, start, end)
            else:
                store.materialize(start, end, BATCH_VIEWS)
        online["materialized"] = [start.isoformat(), end.isoformat()]
    if not cfg.push_recent_events:
        return online
    if newest not in refreshed:
        # A backfill older than the look-back window must not overwrite newer online values with stale ones.
        log.warning(
            "ingest %s: the newest day %s lies outside the look-back window; online recent events kept",
            day,
            newest,
        )
        return online
    with step("push recent events", timings):
        # Merged into what is online (``features.recent_events``): a live event newer than the day's end stays, a
        # re-run changes nothing. A user's merge needs only that user's rows: PUSH_USERS users at a time.
        for tables in recent_rows_by_users(ws, refreshed):
            events, as_of = recent_push_events(tables)
            recent_events.merge_online(store, events, cfg.recent_events, as_of, fast=fast)
            online["pushed_rows"] += sum(table.num_rows for table in tables)
    return online


def recent_rows_by_users(ws: Workspace, days: list[dt.date]) -> Iterator[list[pa.Table]]:
    """The ``days``' recent-events rows, ``PUSH_USERS`` users at a time: the partitions are sorted by user, so a
    user range reads only the row groups that hold it."""
    sources = [ds.dataset(partition_files(ws.offline("user_recent_events", d))) for d in days]
    users = np.unique(
        np.concatenate([s.to_table(columns=["user_id"]).column("user_id").to_numpy() for s in sources])
    )
    for lo in range(0, len(users), PUSH_USERS):
        first, last = int(users[lo]), int(users[min(lo + PUSH_USERS, len(users)) - 1])
        where = (pc.field("user_id") >= first) & (pc.field("user_id") <= last)
        yield [table for source in sources if (table := source.to_table(filter=where)).num_rows]


def recent_push_events(tables: list[pa.Table]) -> tuple[pd.DataFrame, dict[int, int]]:
    """The events of the recent-events tables of the refreshed days (long form), and each user's newest row time
    (µs) among them: the time the merged row is as of."""
    combined = pa.concat_tables(tables)
    stamps = combined.column(EVENT_TS).cast(pa.int64()).to_numpy()
    users = combined.column("user_id").to_numpy()
    as_of: dict[int, int] = {}
    for user, stamp in zip(users.tolist(), stamps.tolist(), strict=True):
        as_of[user] = max(stamp, as_of.get(user, stamp))
    return recent_events.from_view_rows(combined), as_of
