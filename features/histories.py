"""Jagged per-user event histories (values + offsets) and leak-free cut points for training examples.

A history is every accepted event of a user sorted by (ts, event_id); all users' histories are stored back to
back (``values``) with ``offsets[u]:offsets[u+1]`` delimiting user ``u`` — exactly an arrow list column.
For an example of user ``u`` at time ``t``, ``cut`` counts the user's events with ``ts < t`` at the resolution
the histories store (whole seconds): the model reads ``values[offsets[u] : offsets[u] + cut]``, so no event at
or after the example's second can leak in (same-second events are excluded on purpose).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from features.schema import HISTORY_FIELDS

SECOND_US = 1_000_000
# sequences.parquet: one row per user
SEQUENCES_SCHEMA = pa.schema(
    [("user_id", pa.int64())] + [(name, pa.list_(pa.int64())) for name in HISTORY_FIELDS]
)


@dataclass
class Histories:
    user_ids: np.ndarray  # (U,) int64, ascending: row u of the sequences table
    offsets: np.ndarray  # (U + 1,) int64
    values: dict[str, np.ndarray]  # HISTORY_FIELDS -> (offsets[-1],) int64; ``ts`` in int64 seconds

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def to_arrow(self) -> pa.Table:
        """One row per user: ``user_id`` + one list<int64> column per history field (values + offsets)."""
        offsets = pa.array(self.offsets, pa.int64())
        columns = {"user_id": pa.array(self.user_ids, pa.int64())}
        for name in HISTORY_FIELDS:
            columns[name] = pa.LargeListArray.from_arrays(
                offsets, pa.array(self.values[name], pa.int64())
            ).cast(pa.list_(pa.int64()))
        return pa.table(columns, schema=SEQUENCES_SCHEMA)


def build_histories(events: pd.DataFrame) -> Histories:
    """``events``: one row per event with ``event_id``, ``user_id``, ``ts_us`` (int64 microseconds) and every
    HISTORY_FIELDS column except ``ts`` as integer ids. Vectorized: one lexsort, no per-user Python."""
    missing = [c for c in ("event_id", "user_id", "ts_us", *HISTORY_FIELDS[:-1]) if c not in events.columns]
    if missing:
        raise ValueError(f"build_histories: events lack column(s) {missing}")
    user = events["user_id"].to_numpy(np.int64)
    ts_us = events["ts_us"].to_numpy(np.int64)
    order = np.lexsort((events["event_id"].to_numpy(np.int64), ts_us, user))
    user = user[order]
    user_ids, starts = np.unique(user, return_index=True)
    offsets = np.append(starts, len(user)).astype(np.int64)
    values = {name: events[name].to_numpy(np.int64)[order] for name in HISTORY_FIELDS[:-1]}
    values["ts"] = np.floor_divide(ts_us[order], SECOND_US)
    return Histories(user_ids=user_ids, offsets=offsets, values=values)


def cut_points(
    histories: Histories, user_id: np.ndarray, ts_seconds: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(user_row, cut) per example: the user's row in ``histories`` and how many of the user's events have
    ``ts < ts_seconds`` (strictly). Raises if an example's user has no history row."""
    user_id = np.asarray(user_id, np.int64)
    ts_seconds = np.asarray(ts_seconds, np.int64)
    row = np.searchsorted(histories.user_ids, user_id)
    found = row < len(histories.user_ids)
    found[found] = histories.user_ids[row[found]] == user_id[found]
    if not found.all():
        raise ValueError(
            f"cut_points: {int((~found).sum())} example(s) of users without history, e.g. "
            f"user_id {user_id[~found][:5].tolist()}"
        )
    # Sort key (user row, ts): histories are already in this order, so one searchsorted finds every cut.
    lengths = histories.lengths
    hist_row = np.repeat(np.arange(len(histories.user_ids), dtype=np.int64), lengths)
    base = min(int(histories.values["ts"].min(initial=0)), int(ts_seconds.min(initial=0)))
    span = max(int(histories.values["ts"].max(initial=0)), int(ts_seconds.max(initial=0))) - base + 1
    hist_key = hist_row * span + (histories.values["ts"] - base)
    example_key = row * span + (ts_seconds - base)
    cut = np.searchsorted(hist_key, example_key, side="left") - histories.offsets[row]
    return row, cut.astype(np.int64)
