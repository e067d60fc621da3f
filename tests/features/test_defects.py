"""Defect injection: disjoint rows per class, exact counts, deterministic, and each class writes its defect."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from features.schema import ACTIONS, ADS_SCHEMA, DEFECTS, EVENTS_SCHEMA, SURFACES
from features.sources.defects import FAR_FUTURE, inject_defects

DAY = dt.date(2024, 3, 1)


def make_partition(n: int = 2_000, day: dt.date = DAY, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A clean (events, ads) pair in the exact raw schema, small enough for unit tests."""
    rng = np.random.default_rng(seed)
    num_ads = 50
    ads = pd.DataFrame(
        {
            "ad_id": np.arange(num_ads, dtype=np.int64),
            "advertiser_id": rng.integers(0, 10, num_ads),
            "category_id": rng.integers(0, 8, num_ads).astype(np.int32),
            "categories": [np.array([c, (c + 1) % 8], dtype=np.int32) for c in rng.integers(0, 8, num_ads)],
            "quality": rng.random(num_ads).astype(np.float32),
            "created_ts": pd.Timestamp("2024-01-01", tz="UTC")
            + pd.to_timedelta(np.arange(num_ads), unit="h"),
        }
    )
    action = rng.choice(np.asarray(ACTIONS, dtype=object), n)
    impression = action == "impression"
    click = (impression & (rng.random(n) < 0.3)).astype(np.int8)
    conversion = (click.astype(bool) & (rng.random(n) < 0.3)).astype(np.int8)
    start = pd.Timestamp(day.isoformat(), tz="UTC")
    events = pd.DataFrame(
        {
            "event_id": np.arange(n, dtype=np.int64) + 1_000_000,
            "user_id": rng.integers(0, 200, n),
            "ad_id": rng.integers(0, num_ads, n),
            "action": action,
            "surface": rng.choice(np.asarray(SURFACES, dtype=object), n),
            "ts": (start + pd.to_timedelta(np.sort(rng.integers(0, 86_400_000_000, n)), unit="us")).astype(
                "datetime64[us, UTC]"
            ),
            "click": click,
            "conversion": conversion,
        }
    )
    # Both frames fit the contract exactly.
    pa.Table.from_pandas(events, schema=EVENTS_SCHEMA, preserve_index=False)
    pa.Table.from_pandas(ads, schema=ADS_SCHEMA, preserve_index=False)
    return events, ads


def _inject(events, ads, defects, seed=1):
    return inject_defects(events, defects, day=DAY, ads=ads, rng=np.random.default_rng(seed))


@pytest.mark.parametrize("defect", [d for d in DEFECTS if d != "volume_drop"])
def test_each_class_corrupts_the_requested_share_of_rows(defect):
    events, ads = make_partition()
    out, counts = _inject(events, ads, {defect: 0.05})
    assert len(out) == len(events)
    assert counts == {defect: pytest.approx(100, abs=5)}
    changed = _changed_rows(events, out)
    assert changed == counts[defect]


def test_classes_touch_disjoint_rows_and_counts_add_up():
    events, ads = make_partition()
    rates = {d: 0.03 for d in DEFECTS if d != "volume_drop"}
    out, counts = _inject(events, ads, rates)
    assert set(counts) == set(rates)
    assert _changed_rows(events, out) == sum(counts.values())


def test_volume_drop_removes_clean_rows_and_reports_them():
    events, ads = make_partition()
    out, counts = _inject(events, ads, {"volume_drop": 0.9, "bad_enum": 0.01})
    assert counts["volume_drop"] == 1_800
    assert len(out) == len(events) - 1_800
    # the corrupted rows all survive the drop
    assert (~out["action"].isin(ACTIONS) | ~out["surface"].isin(SURFACES)).sum() == counts["bad_enum"]


def test_defects_write_what_they_claim():
    events, ads = make_partition()
    nulls, _ = _inject(events, ads, {"null_field": 0.1})
    assert nulls.isna().any(axis=1).sum() == 200

    bad, _ = _inject(events, ads, {"bad_type": 0.1})
    text_columns = [c for c in ("user_id", "ad_id", "click", "conversion") if bad[c].dtype == object]
    assert len(text_columns) == 1
    parsed = pd.to_numeric(bad[text_columns[0]], errors="coerce")
    assert parsed.isna().sum() == 200  # the garbage; every other row still parses

    future, _ = _inject(events, ads, {"future_ts": 0.1})
    assert (future["ts"] >= FAR_FUTURE).sum() == 200

    window, _ = _inject(events, ads, {"outside_window": 0.1})
    assert (window["ts"] < pd.Timestamp(DAY.isoformat(), tz="UTC")).sum() == 200

    dup, counts = _inject(events, ads, {"duplicate_event_id": 0.1})
    assert dup["event_id"].duplicated().sum() == counts["duplicate_event_id"]
    assert dup.duplicated().sum() == counts["duplicate_event_id"]  # full replays of earlier rows

    unknown, _ = _inject(events, ads, {"unknown_ad": 0.1})
    assert (~unknown["ad_id"].isin(ads["ad_id"])).sum() == 200

    labels, _ = _inject(events, ads, {"label_action_mismatch": 0.1})
    organic_label = (labels["action"] != "impression") & ((labels["click"] > 0) | (labels["conversion"] > 0))
    conversion_without_click = labels["conversion"] > labels["click"]
    assert (organic_label | conversion_without_click).sum() == 200


def test_deterministic_for_a_seed():
    events, ads = make_partition()
    rates = {"null_field": 0.02, "bad_type": 0.02, "duplicate_event_id": 0.02, "volume_drop": 0.1}
    a, ca = _inject(events, ads, rates, seed=7)
    b, cb = _inject(events, ads, rates, seed=7)
    pd.testing.assert_frame_equal(a, b)
    assert ca == cb


def test_input_frame_is_not_modified():
    events, ads = make_partition()
    before = events.copy()
    _inject(events, ads, {d: 0.05 for d in DEFECTS})
    pd.testing.assert_frame_equal(events, before)


@pytest.mark.parametrize(
    ("defects", "message"),
    [
        ({"gremlins": 0.1}, "unknown defect class"),
        ({"null_field": 1.5}, "must be in \\[0, 1\\]"),
        ({"null_field": 0.6, "bad_enum": 0.6}, "sum to at most 1"),
    ],
)
def test_bad_arguments_are_named(defects, message):
    events, ads = make_partition(n=100)
    with pytest.raises(ValueError, match=message):
        _inject(events, ads, defects)


def test_unknown_ad_needs_the_ads_table():
    events, _ = make_partition(n=100)
    with pytest.raises(ValueError, match="needs the ads table"):
        inject_defects(events, {"unknown_ad": 0.1}, day=DAY, ads=None, rng=np.random.default_rng(0))


def _changed_rows(before: pd.DataFrame, after: pd.DataFrame) -> int:
    """Rows whose values differ in any column (comparing text forms, so a retyped column compares fairly)."""
    a = before.astype("string").fillna("<null>")
    b = after.astype("string").fillna("<null>")
    return int((a != b).any(axis=1).sum())
