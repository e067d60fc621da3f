"""Per-user recent-event lists: the one merge (existing list + new events -> newest N) every writer uses.

A list is a user's newest ``n`` events in the order the training histories use (``features.histories``: by
``(ts_us, event_id)``, oldest first), deduplicated by ``event_id``. The daily table (``features.stats``), the
daily ingest's online push (``features.ingest``) and the live event path (``serving.events``) all go through
``merge``, so an online list is exactly the last ``n`` events of the user's history whichever wrote it, a retried
event counts once, and a daily push never erases live events newer than its day's end.

Events travel in "long" form: one row per event with ``EVENT_COLUMNS`` (int64; ``action`` / ``surface`` as
vocabulary ids, ``ts_us`` in microseconds). A view row (``USER_RECENT_EVENTS``) carries ``recent_event_ids`` and
``recent_ts_us`` besides the model's fields, so a stored list can be merged again exactly.

Row timestamps: a row's ``event_timestamp`` is its "as of" time (time gaps are measured to it). A merged row is
stamped at least 1 µs after the row it replaces: Feast's Redis writer skips a row that is not newer than the stored
one (to the µs), and the merged row always supersedes it (it holds all of it that still fits). Feast's SQLite
store keeps whole seconds and writes unconditionally.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa

from features.feature_repo.tables import CREATED_TS, EVENT_TS, USER_RECENT_EVENTS

if TYPE_CHECKING:
    from features.list_cache import ListCache

EVENT_COLUMNS: tuple[str, ...] = (
    "user_id",
    "event_id",
    "ts_us",
    "ad_id",
    "action",
    "category_id",
    "surface",
    "advertiser_id",
)
# view list column <- long-form column (recent_ts and recent_time_gaps are derived from ts_us)
LIST_COLUMNS: dict[str, str] = {
    "recent_event_ids": "event_id",
    "recent_ts_us": "ts_us",
    "recent_ad_ids": "ad_id",
    "recent_actions": "action",
    "recent_category_ids": "category_id",
    "recent_surfaces": "surface",
    "recent_advertiser_ids": "advertiser_id",
}
VIEW_FEATURES: tuple[str, ...] = tuple(f.name for f in USER_RECENT_EVENTS if f.name.startswith("recent_"))
SECOND_US = 1_000_000
READ_CHUNK = 10_000  # entity keys per online read (SQLite caps bound parameters)


def empty_events() -> pd.DataFrame:
    return pd.DataFrame({c: np.empty(0, np.int64) for c in EVENT_COLUMNS})


def long_events(events: pd.DataFrame) -> pd.DataFrame:
    """``events`` reduced to ``EVENT_COLUMNS`` as int64 (raises naming missing columns)."""
    missing = [c for c in EVENT_COLUMNS if c not in events.columns]
    if missing:
        raise ValueError(f"recent events: missing column(s) {missing}")
    return pd.DataFrame({c: events[c].to_numpy(np.int64) for c in EVENT_COLUMNS})


def merge(existing: pd.DataFrame, new: pd.DataFrame, n: int) -> pd.DataFrame:
    """Existing lists + new events -> every user's newest ``n`` events, by (user, ts_us, event_id).

    An ``event_id`` seen twice counts once (the existing copy wins: a retry never rewrites history). Late and
    out-of-order events land in their place. Vectorized: one concat, one lexsort, no per-user Python."""
    if n <= 0:
        raise ValueError(f"recent events: n must be positive, got {n}")
    both = pd.concat([long_events(existing), long_events(new)], ignore_index=True)
    both = both[~both["event_id"].duplicated(keep="first")]
    user, ts_us, event_id = (both[c].to_numpy(np.int64) for c in ("user_id", "ts_us", "event_id"))
    order = np.lexsort((event_id, ts_us, user))
    user = user[order]
    _, starts, counts = np.unique(user, return_index=True, return_counts=True)
    from_end = np.repeat(starts + counts, counts) - np.arange(len(user))
    return both.iloc[order[from_end <= n]].reset_index(drop=True)


def view_rows(events: pd.DataFrame, as_of_us: dict[int, int] | int) -> pa.Table:
    """Merged long-form events (sorted as ``merge`` returns them) -> one ``USER_RECENT_EVENTS`` row per user,
    stamped ``as_of_us`` (one time for all users, or per user)."""
    user = events["user_id"].to_numpy(np.int64)
    users, counts = np.unique(user, return_counts=True)
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]), pa.int32())
    if isinstance(as_of_us, dict):
        stamps = np.array([as_of_us[int(u)] for u in users], np.int64)
    else:
        stamps = np.full(len(users), int(as_of_us), np.int64)
    ts_us = events["ts_us"].to_numpy(np.int64)
    gaps = ((np.repeat(stamps, counts) - ts_us) / 1e6).astype(np.float32)

    def lists(values: np.ndarray, kind: pa.DataType = pa.int64()) -> pa.ListArray:
        return pa.ListArray.from_arrays(offsets, pa.array(values, kind))

    columns = {name: lists(events[src].to_numpy(np.int64)) for name, src in LIST_COLUMNS.items()}
    columns["recent_ts"] = lists(np.floor_divide(ts_us, SECOND_US))
    columns["recent_time_gaps"] = lists(gaps, pa.float32())
    stamp = pa.array(stamps, pa.timestamp("us", tz="UTC"))
    table = pa.table({"user_id": pa.array(users, pa.int64()), **columns, EVENT_TS: stamp, CREATED_TS: stamp})
    return table.select(USER_RECENT_EVENTS.names).cast(USER_RECENT_EVENTS)


def from_view_rows(table: pa.Table) -> pd.DataFrame:
    """View rows -> long-form events. Rows written before the view carried event ids cannot be merged exactly:
    they are left out (the merge then rebuilds the list from the events it is given)."""
    lengths = table.column("recent_event_ids").combine_chunks().value_lengths().to_numpy(zero_copy_only=False)
    users = table.column("user_id").to_numpy()
    out = {"user_id": np.repeat(users.astype(np.int64), np.nan_to_num(lengths).astype(np.int64))}
    for name, src in LIST_COLUMNS.items():
        out[src] = (
            table.column(name).combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        )
    return pd.DataFrame(out)[list(EVENT_COLUMNS)]


def read_online(store, user_ids: Sequence[int], view=None) -> tuple[pd.DataFrame, dict[int, int]]:
    """The stored lists of ``user_ids`` (long form) and each found row's timestamp (µs), from the online store
    the view lives in (Feast's own ``online_read``, the call serving makes). ``view``: the resolved
    ``user_recent_events`` view (else looked up in the registry)."""
    from feast.protos.feast.types.EntityKey_pb2 import EntityKey
    from feast.protos.feast.types.Value_pb2 import Value
    from feast.type_map import feast_value_type_to_python_type

    view = view if view is not None else store.get_feature_view("user_recent_events")
    online_store = store._get_provider().online_store
    rows: dict[str, list] = {"user_id": [], **{name: [] for name in LIST_COLUMNS}}
    stamps: dict[int, int] = {}
    ids = [int(u) for u in user_ids]
    for lo in range(0, len(ids), READ_CHUNK):
        chunk = ids[lo : lo + READ_CHUNK]
        keys = [EntityKey(join_keys=["user_id"], entity_values=[Value(int64_val=u)]) for u in chunk]
        found = online_store.online_read(store.config, view, keys, list(LIST_COLUMNS))
        for user, (ts, values) in zip(chunk, found, strict=True):
            if ts is None or not values:
                continue
            stamps[user] = _micros(ts)
            lists = {name: values.get(name) for name in LIST_COLUMNS}
            if any(v is None or v.WhichOneof("val") is None for v in lists.values()):
                continue  # a row from before the identity fields: nothing to merge exactly
            rows["user_id"].append(user)
            for name, value in lists.items():
                rows[name].append(_int64s(value, feast_value_type_to_python_type))
    if not rows["user_id"]:
        return empty_events(), stamps
    table = pa.table(
        {"user_id": pa.array(rows["user_id"], pa.int64())}
        | {name: pa.array(rows[name], pa.list_(pa.int64())) for name in LIST_COLUMNS}
    )
    return from_view_rows(table), stamps


def merge_online(
    store,
    new: pd.DataFrame,
    n: int,
    as_of_us: dict[int, int] | int,
    fast: bool = True,
    views=None,
    cache: ListCache | None = None,
) -> pa.Table:
    """Merge ``new`` (long form) into the online lists of its users and write them in one push; returns the
    rows written. Each row is stamped max(``as_of_us``, the stored row's time + 1 µs). ``fast``: the vectorized
    writer (``features.feature_repo.online``), else Feast's own ``push``. ``views``: the views of the push source,
    resolved once by a caller that merges many times (``online.push_views``). ``cache``: the lists this writer
    wrote last (``features.list_cache``; a single writer's), read back without decoding them."""
    from features.feature_repo import RECENT_EVENTS_PUSH
    from features.feature_repo import online as online_writes

    users = np.unique(new["user_id"].to_numpy(np.int64))
    if len(users) == 0:
        return view_rows(empty_events(), 0)
    view = next((v for v in views if v.name == "user_recent_events"), None) if views else None
    if cache is None:
        existing, stored = read_online(store, users, view)
    else:
        existing, stored, unknown = cache.lookup(users, EVENT_COLUMNS)
        if len(unknown):
            read, read_stamps = read_online(store, unknown, view)
            existing, stored = pd.concat([existing, read], ignore_index=True), stored | read_stamps
    merged = merge(existing, new, n)
    wanted = as_of_us if isinstance(as_of_us, dict) else dict.fromkeys(users.tolist(), int(as_of_us))
    stamps = {int(u): max(wanted[int(u)], stored.get(int(u), -1) + 1) for u in users}
    table = view_rows(merged, stamps)
    if fast:
        online_writes.push(store, RECENT_EVENTS_PUSH, table, views)
    else:
        from feast.data_source import PushMode

        store.push(RECENT_EVENTS_PUSH, table.to_pandas(), to=PushMode.ONLINE)
    if cache is not None:
        cache.remember(table, merged)
    return table


def _int64s(value, convert) -> list[int]:
    """An int64 list value as Python ints: read straight off the proto (Feast's general converter costs ~20 µs a
    value, a third of the collector's time); any other kind goes through Feast's ``convert``."""
    if value.WhichOneof("val") == "int64_list_val":
        return list(value.int64_list_val.val)
    return convert(value)


def _micros(ts) -> int:
    ts = pd.Timestamp(ts)
    ts = ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")
    return int(ts.value // 1000)
