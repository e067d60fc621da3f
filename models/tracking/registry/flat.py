"""The registered models' row format: one row per (user, candidate) example, the user's history inline.

Columns: every column of the training set's example rows (``examples.parquet``, plus the Feast features of
``ranker.parquet`` for a ranker) and one list column per history field, ``hist_<field>``, holding the user's
events before the example (oldest first). It is what an MLflow signature can describe and what a batch
scorer can send without the training-set folder. ``to_frame`` cuts rows out of a training set; ``to_training_set``
turns a frame back into one (a temporary folder) so scoring reuses exactly the training code path.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from features.schema import HISTORY_FIELDS
from models.training.data import USER_VOCAB_ROW, TrainingSet

HIST = "hist_"
JOIN_TIMESTAMPS = ("event_timestamp", "created_timestamp")


def to_frame(data: TrainingSet, rows: np.ndarray, max_history: int) -> pd.DataFrame:
    base = data.ranker if data.ranker is not None else data.examples
    # Feast's join timestamps are bookkeeping, not model inputs (and MLflow schemas take no tz-aware times)
    frame = base.iloc[rows].drop(columns=list(JOIN_TIMESTAMPS), errors="ignore").reset_index(drop=True)
    for col in data.examples.columns:  # examples' columns win (ids, cut, labels)
        frame[col] = data.examples[col].to_numpy()[rows]
    frame["ad_id"] = data.raw_ids["ad_id"][rows]  # raw ids, as a caller sends them (the model maps them)
    for col in frame.columns:  # float lists as float64: what MLflow's schema check converts them to
        first = frame[col].dropna().head(1).tolist()
        if first and isinstance(first[0], list | np.ndarray) and np.asarray(first[0]).dtype.kind == "f":
            frame[col] = [None if v is None else np.asarray(v, np.float64) for v in frame[col]]
    ex = data.examples
    user_row, cut = ex["user_row"].to_numpy()[rows], ex["cut"].to_numpy()[rows]
    start = data.seq_offsets[user_row] + np.maximum(0, cut - max_history)
    end = data.seq_offsets[user_row] + cut
    for field in HISTORY_FIELDS:
        values = data.raw_ids["seq_ad_id"] if field == "ad_id" else data.seq_values[field]
        frame[HIST + field] = [values[s:e].tolist() for s, e in zip(start, end, strict=True)]
    return frame.drop(columns=["user_row", "cut", "split", USER_VOCAB_ROW], errors="ignore")


def to_training_set(frame: pd.DataFrame, folder: Path) -> TrainingSet:
    """Write ``frame`` as a training set (each row its own user sequence) and load it."""
    missing = [HIST + f for f in HISTORY_FIELDS if HIST + f not in frame]
    if missing:
        raise ValueError(f"model input lacks history column(s) {missing}")
    folder.mkdir(parents=True, exist_ok=True)
    n = len(frame)
    seqs = {"user_id": pa.array(frame["user_id"].to_numpy(np.int64))}
    for field in HISTORY_FIELDS:
        seqs[field] = pa.array([list(map(int, v)) for v in frame[HIST + field]], pa.list_(pa.int64()))
    pq.write_table(pa.table(seqs), folder / "sequences.parquet")
    rest = frame.drop(columns=[HIST + f for f in HISTORY_FIELDS])
    rest = rest.assign(
        user_row=np.arange(n),
        cut=[len(v) for v in frame[HIST + "ad_id"]],
        split="test",
        **{label: rest.get(label, 0) for label in ("click", "conversion")},
    )
    if "example_id" not in rest:
        rest["example_id"] = np.arange(n)
    rest.to_parquet(folder / "examples.parquet", index=False)
    rest.to_parquet(folder / "ranker.parquet", index=False)
    (folder / "manifest.json").write_text(json.dumps({"source": "model input"}))
    return TrainingSet(folder)
