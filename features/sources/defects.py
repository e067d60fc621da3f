"""Defect injection: corrupt a raw events partition with known defects, so the validation gate can be tested.

Each defect class of ``features.schema.DEFECTS`` corrupts ``rate * len(events)`` rows. The rows of different
classes are disjoint, so every corrupted row carries exactly one known defect; the returned counts are the
ground truth the gate's quarantine must reproduce. ``volume_drop`` is different: its rate is the fraction of the
partition *removed* (taken from rows no other class touched), and its count is the number of rows removed.

What each class writes (events table):
- ``null_field``: one required column of the row becomes null (int columns turn into pandas ``Int64``);
- ``bad_type``: one numeric column is rewritten as strings for the whole partition, garbage in the chosen rows;
- ``out_of_range``: ``user_id`` or ``ad_id`` becomes negative;
- ``bad_enum``: ``action`` or ``surface`` outside its vocabulary;
- ``future_ts``: a timestamp in 2100 (after any ingestion's wall clock; fixed so injection stays deterministic);
- ``outside_window``: a timestamp up to three days before the partition's day;
- ``duplicate_event_id``: the row becomes a replay (full copy) of an earlier clean row;
- ``label_action_mismatch``: a click on a non-impression, or a conversion without click on an impression;
- ``unknown_ad``: an ``ad_id`` missing from the ads table;
- ``volume_drop``: rows removed.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

import numpy as np
import pandas as pd

from features.schema import DEFECTS, EVENTS_SCHEMA

# Every class except volume_drop corrupts rows in place; volume_drop removes clean rows afterwards.
ROW_DEFECTS: tuple[str, ...] = tuple(d for d in DEFECTS if d != "volume_drop")
NULLABLE_COLUMNS: tuple[str, ...] = tuple(EVENTS_SCHEMA.names)
BAD_TYPE_COLUMNS: tuple[str, ...] = ("user_id", "ad_id", "click", "conversion")
GARBAGE: tuple[str, ...] = ("N/A", "12abc", "#REF!", "?", "1.5e", "--", "none?", "0x1F")
FAR_FUTURE = pd.Timestamp("2100-01-01", tz="UTC")


def inject_defects(
    events: pd.DataFrame,
    defects: Mapping[str, float],
    *,
    day: dt.date,
    ads: pd.DataFrame,
    rng: np.random.Generator,
) -> tuple[pd.DataFrame, dict[str, int]]:
    """Return a corrupted copy of ``events`` and, per requested defect class, how many rows it affected."""
    rates = _check_rates(defects)
    missing = sorted(set(EVENTS_SCHEMA.names) - set(events.columns))
    if missing:
        raise ValueError(f"inject_defects: events lack column(s) {missing}; expected {EVENTS_SCHEMA.names}")
    out = events.reset_index(drop=True).copy()
    n = len(out)

    # Disjoint row sets: one shuffled order, consecutive slices per class.
    order = rng.permutation(n)
    rows: dict[str, np.ndarray] = {}
    start = 0
    for name in ROW_DEFECTS:
        take = int(round(rates.get(name, 0.0) * n))
        rows[name] = np.sort(order[start : start + take])
        start += take
    clean = np.sort(order[start:])

    counts: dict[str, int] = {}
    if "duplicate_event_id" in rates:
        # Decide the replays first: their sources must stay clean and survive volume_drop.
        rows["duplicate_event_id"], sources = _replay_sources(rows["duplicate_event_id"], clean, rng)
    appliers = {
        "null_field": lambda r: _null_field(out, r, rng),
        "bad_type": lambda r: _bad_type(out, r, rng),
        "out_of_range": lambda r: _out_of_range(out, r, rng),
        "bad_enum": lambda r: _bad_enum(out, r, rng),
        "future_ts": lambda r: _set_ts(out, r, FAR_FUTURE + _offsets(rng, len(r), days=1)),
        "outside_window": lambda r: _set_ts(out, r, _day_start(day) - _offsets(rng, len(r), days=3, min_s=1)),
        "duplicate_event_id": lambda r: _replay(out, r, sources),
        "label_action_mismatch": lambda r: _label_mismatch(out, r),
        "unknown_ad": lambda r: _unknown_ad(out, r, ads, rng),
    }
    # bad_type last among in-place classes: it rewrites a whole column as text, after the others wrote values.
    for name in sorted(rates, key=lambda d: (d == "bad_type", DEFECTS.index(d))):
        if name == "volume_drop":
            continue
        appliers[name](rows[name])
        counts[name] = int(len(rows[name]))

    if "volume_drop" in rates:
        protected = np.unique(sources) if "duplicate_event_id" in rates else np.empty(0, dtype=np.int64)
        removable = np.setdiff1d(clean, protected, assume_unique=True)
        drop = rng.permutation(removable)[: int(round(rates["volume_drop"] * n))]
        out = out.drop(index=drop).reset_index(drop=True)
        counts["volume_drop"] = int(len(drop))
    return out, counts


def _check_rates(defects: Mapping[str, float]) -> dict[str, float]:
    rates = dict(defects)
    unknown = sorted(set(rates) - set(DEFECTS))
    if unknown:
        raise ValueError(f"unknown defect class(es) {unknown}; known: {list(DEFECTS)}")
    for name, rate in rates.items():
        if not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"defect rate for {name} must be in [0, 1], got {rate!r}")
    total = sum(float(r) for name, r in rates.items() if name != "volume_drop")
    if total > 1.0:
        raise ValueError(f"defect rates (except volume_drop) must sum to at most 1, got {total:.3f}")
    return {name: float(rate) for name, rate in rates.items()}


def _day_start(day: dt.date) -> pd.Timestamp:
    return pd.Timestamp(day.isoformat(), tz="UTC")


def _offsets(rng: np.random.Generator, k: int, *, days: int, min_s: int = 0) -> pd.TimedeltaIndex:
    seconds = rng.integers(min_s, days * 86_400, size=k)
    return pd.to_timedelta(seconds, unit="s")


def _nullable(out: pd.DataFrame, column: str) -> None:
    """Give an int column a dtype that can hold nulls (pandas ``Int8``..``Int64``) before writing them."""
    dtype = out[column].dtype
    if pd.api.types.is_integer_dtype(dtype) and not pd.api.types.is_extension_array_dtype(dtype):
        out[column] = out[column].astype(str(dtype).capitalize())  # int8 -> Int8, int64 -> Int64


def _null_field(out: pd.DataFrame, rows: np.ndarray, rng: np.random.Generator) -> None:
    which = rng.integers(0, len(NULLABLE_COLUMNS), size=len(rows))
    for i, column in enumerate(NULLABLE_COLUMNS):
        target = rows[which == i]
        if len(target) == 0:
            continue
        _nullable(out, column)
        col = out.columns.get_loc(column)
        out.iloc[target, col] = None


def _bad_type(out: pd.DataFrame, rows: np.ndarray, rng: np.random.Generator) -> None:
    column = BAD_TYPE_COLUMNS[int(rng.integers(0, len(BAD_TYPE_COLUMNS)))]
    values = out[column]
    # The whole column becomes text (as a CSV export would write it); nulls stay nulls.
    text = values.astype("string").astype(object).where(values.notna(), None)
    garbage = np.asarray(GARBAGE, dtype=object)[rng.integers(0, len(GARBAGE), size=len(rows))]
    text.iloc[rows] = garbage
    out[column] = text


def _out_of_range(out: pd.DataFrame, rows: np.ndarray, rng: np.random.Generator) -> None:
    use_ad = rng.random(len(rows)) < 0.5
    for column, target in (("ad_id", rows[use_ad]), ("user_id", rows[~use_ad])):
        if len(target) == 0:
            continue
        col = out.columns.get_loc(column)
        out.iloc[target, col] = -1 - out.iloc[target, col].to_numpy(dtype=np.int64)


def _bad_enum(out: pd.DataFrame, rows: np.ndarray, rng: np.random.Generator) -> None:
    use_action = rng.random(len(rows)) < 0.5
    out.iloc[rows[use_action], out.columns.get_loc("action")] = "purchase_intent"
    out.iloc[rows[~use_action], out.columns.get_loc("surface")] = "billboard"


def _set_ts(out: pd.DataFrame, rows: np.ndarray, values: pd.DatetimeIndex) -> None:
    out.iloc[rows, out.columns.get_loc("ts")] = values.astype(out["ts"].dtype)


def _replay_sources(
    targets: np.ndarray, clean: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """For each target row, a clean row at an earlier position to replay (targets with none are skipped)."""
    earlier = np.searchsorted(clean, targets)  # how many clean rows lie before each target
    keep = earlier > 0
    targets, earlier = targets[keep], earlier[keep]
    sources = clean[np.floor(rng.random(len(targets)) * earlier).astype(np.int64)]
    return targets, sources


def _replay(out: pd.DataFrame, targets: np.ndarray, sources: np.ndarray) -> None:
    for col in range(out.shape[1]):  # column by column, so every column keeps its dtype
        out.iloc[targets, col] = out.iloc[sources, col].to_numpy()


def _label_mismatch(out: pd.DataFrame, rows: np.ndarray) -> None:
    is_impression = out["action"].to_numpy()[rows] == "impression"
    click, conversion = out.columns.get_loc("click"), out.columns.get_loc("conversion")
    # A label on an organic/follow-up action ...
    out.iloc[rows[~is_impression], click] = 1
    # ... or a conversion without its click on an impression.
    out.iloc[rows[is_impression], click] = 0
    out.iloc[rows[is_impression], conversion] = 1


def _unknown_ad(out: pd.DataFrame, rows: np.ndarray, ads: pd.DataFrame, rng: np.random.Generator) -> None:
    if ads is None or "ad_id" not in ads or ads["ad_id"].isna().all():
        raise ValueError("unknown_ad needs the ads table (a frame with ad_id) to pick ids that are not in it")
    first_unknown = int(pd.to_numeric(ads["ad_id"], errors="coerce").max()) + 1
    out.iloc[rows, out.columns.get_loc("ad_id")] = first_unknown + rng.integers(0, 1_000_000, size=len(rows))
