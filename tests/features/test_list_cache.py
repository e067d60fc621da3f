"""The collector's cache of the lists it wrote: a hit is exactly what Feast's online read returns, and a row another
writer changed is read through Feast again."""

from __future__ import annotations

import numpy as np
import pandas as pd

from features import recent_events
from features.feature_repo import RECENT_EVENTS_PUSH, FeatureStoreConfig
from features.feature_repo.online import push_views
from features.list_cache import ListCache
from features.store import open_store
from tests.features.test_recent_events import events

T0 = 1_767_225_600_000_000  # 2026-01-01, µs


def _lists(store, users) -> dict[int, list[int]]:
    found, _ = recent_events.read_online(store, users)
    return {int(u): g["event_id"].tolist() for u, g in found.groupby("user_id")}


def test_cache_hits_equal_feasts_read_and_another_writers_rows_are_read_again(workspace):
    store = open_store(workspace, FeatureStoreConfig(), apply=True)
    views = push_views(store, RECENT_EVENTS_PUSH)
    view = next(v for v in views if v.name == "user_recent_events")
    cache = ListCache.of(store, view, recent_events.LIST_COLUMNS)
    assert cache is not None  # the default online store is Feast's SQLite one

    def merge(rows, as_of, cached=True):
        recent_events.merge_online(
            store, events(rows), 2, as_of, views=views, cache=cache if cached else None
        )

    merge([(1, 1, T0), (2, 2, T0), (3, 3, T0 + 10)], T0 + 2_000_000)
    merge([(2, 20, T0 + 5)], T0 + 3_000_000, cached=False)  # another writer (the daily push) changes user 2

    cached, stamps, unknown = cache.lookup(np.array([1, 2, 3, 4]), recent_events.EVENT_COLUMNS)
    assert unknown.tolist() == [2, 4]  # 2: not the bytes this writer wrote; 4: never written by it
    read, read_stamps = recent_events.read_online(store, [1, 3])
    pd.testing.assert_frame_equal(cached, read)
    assert stamps == read_stamps

    # a merge through the cache lands like one through Feast's read: user 2 keeps the other writer's event
    merge([(1, 11, T0 + 20), (2, 21, T0 + 20), (4, 41, T0 + 20), (2, 2, T0)], T0 + 4_000_000)
    assert _lists(store, [1, 2, 3, 4]) == {1: [1, 11], 2: [20, 21], 3: [3], 4: [41]}
    cached, _, unknown = cache.lookup(np.array([1, 2, 3, 4]), recent_events.EVENT_COLUMNS)
    assert unknown.tolist() == []
    pd.testing.assert_frame_equal(cached, recent_events.read_online(store, [1, 2, 3, 4])[0])
