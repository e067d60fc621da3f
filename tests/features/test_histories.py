"""Jagged histories: values + offsets in (ts, event_id) order, and cut points that never leak."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from features.histories import SECOND_US, build_histories, cut_points
from features.schema import HISTORY_FIELDS


def _events(rng: np.random.Generator, n: int, users: int) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "event_id": rng.permutation(n).astype(np.int64),
            "user_id": rng.integers(0, users, n) * 7 + 3,  # sparse, unsorted ids
            "ts_us": rng.integers(0, 50, n) * SECOND_US
            + rng.integers(0, SECOND_US, n),  # many same-second ties
            "ad_id": rng.integers(0, 100, n),
            "action": rng.integers(0, 8, n),
            "surface": rng.integers(0, 5, n),
            "category_id": rng.integers(0, 10, n),
            "advertiser_id": rng.integers(0, 20, n),
        }
    )


def test_histories_are_sorted_per_user_and_complete():
    events = _events(np.random.default_rng(0), 500, 17)
    h = build_histories(events)
    assert h.offsets[0] == 0 and h.offsets[-1] == len(events)
    assert np.all(np.diff(h.user_ids) > 0)
    for row, user in enumerate(h.user_ids):
        mine = events[events.user_id == user].sort_values(["ts_us", "event_id"])
        seg = slice(h.offsets[row], h.offsets[row + 1])
        assert np.array_equal(h.values["ad_id"][seg], mine.ad_id.to_numpy())
        assert np.array_equal(h.values["ts"][seg], mine.ts_us.to_numpy() // SECOND_US)


def test_arrow_table_is_values_plus_offsets():
    events = _events(np.random.default_rng(1), 200, 9)
    h = build_histories(events)
    table = h.to_arrow()
    assert table.column_names == ["user_id", *HISTORY_FIELDS]
    col = table.column("category_id").combine_chunks()
    assert np.array_equal(col.offsets.to_numpy(), h.offsets)
    assert np.array_equal(col.values.to_numpy(), h.values["category_id"])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000), n=st.integers(1, 300), users=st.integers(1, 12), queries=st.integers(1, 50)
)
def test_cut_never_includes_an_event_at_or_after_the_example(seed, n, users, queries):
    rng = np.random.default_rng(seed)
    events = _events(rng, n, users)
    h = build_histories(events)
    q_user = rng.choice(h.user_ids, queries)
    q_ts = rng.integers(-1, 52, queries)  # seconds, including before/after every event
    row, cut = cut_points(h, q_user, q_ts)
    for u, t, r, c in zip(q_user, q_ts, row, cut, strict=True):
        assert h.user_ids[r] == u
        seq = h.values["ts"][h.offsets[r] : h.offsets[r + 1]]
        assert np.all(seq[:c] < t), "an event at or after the example leaked into its history"
        assert np.all(seq[c:] >= t), "an event strictly before the example was dropped"


def test_cut_rejects_unknown_users():
    h = build_histories(_events(np.random.default_rng(2), 50, 3))
    with pytest.raises(ValueError, match="999999"):
        cut_points(h, np.array([999_999]), np.array([5]))
