"""A training set (``features.training_sets``' on-disk contract) loaded as flat arrays, jagged end to end.

A training set folder holds ``sequences.parquet`` (one row per user, one list column per history field),
``examples.parquet`` (one row per impression: ``user_row`` + ``cut`` locate its history),
``ranker.parquet`` (the examples joined point-in-time with Feast features) and ``manifest.json``.
Arrow list columns are already values + offsets: we keep them flat and slice each example's history
``[max(0, cut - L), cut)`` by index arithmetic, never padding.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from features.schema import ACTIONS, GENDERS, HISTORY_FIELDS, SURFACES
from features.splits import leave_one_out_split  # noqa: F401  (re-exported: the models' split helpers)
from features.vocabulary import Vocabulary, load_vocabularies
from models.architectures.transforms import fresh_cutoff, previous_gaps, time_bucket
from models.training.batch import CANDIDATE_ID_FIELDS, Candidates, Events, Profile

LABELS = ("click", "conversion")
USER_VOCAB_ROW = "user_vocab_row"  # examples' user_id as the row of the model's user table (an id column)
DAY_S = 86_400
# Where the user model cuts each example's history: at the example itself, or at the start of its day.
SNAPSHOTS = {"example": 0, "day": DAY_S}
EXAMPLE_COLUMNS = ("user_id", "user_row", "cut", "ad_id", "advertiser_id", "category_id", "surface", "ts")
# Columns of ranker.parquet that are labels, bookkeeping or profile, never dense candidate inputs (every
# ``*_id`` column is an id, embedded or ignored, never a number).
NOT_DENSE = {
    "user_row", "cut", "surface", "ts", "click", "conversion", "split", "user_embedding", "model_version",
    "event_timestamp", "created", "created_ts", USER_VOCAB_ROW, *(f"{p}{c}" for p in ("", "user_") for c in ("age", "gender", "country")),
}  # fmt: skip
# The user profile as ranker.parquet names it (Feast ``user_profile`` view), with plain names as fallback.
PROFILE_COLUMNS = {
    "age": ("user_age", "age"),
    "gender": ("user_gender", "gender"),
    "country": ("user_country", "country"),
}


def profile_column(frame: pd.DataFrame, what: str) -> np.ndarray | None:
    """The profile field ``what`` as float64 (NaN where the point-in-time join found no profile), or None."""
    for name in PROFILE_COLUMNS[what]:
        if name in frame:
            return pd.to_numeric(frame[name], errors="coerce").to_numpy(np.float64)
    return None


class TrainingSetError(ValueError):
    """A training-set folder is missing a file or a column, or holds inconsistent rows."""


class TrainingSet:
    """One training-set folder loaded into flat arrays: histories stay values + offsets."""

    def __init__(
        self, path: Path, *, require_ranker: bool = False, vocabularies: dict[str, Vocabulary] | None = None
    ):
        """``vocabularies``: map raw ids with these (a trained model's) instead of the set's own."""
        self.path = Path(path)
        for name in ("sequences.parquet", "examples.parquet"):
            if not (self.path / name).exists():
                raise TrainingSetError(f"{self.path} is not a training set: {name} is missing")
        self.manifest = _read_json(self.path / "manifest.json")
        self._load_sequences(pq.read_table(self.path / "sequences.parquet"))
        self.examples = _normalize_examples(pd.read_parquet(self.path / "examples.parquet"), self.path)
        self.ranker: pd.DataFrame | None = None
        if (self.path / "ranker.parquet").exists():
            self.ranker = _align_ranker(pd.read_parquet(self.path / "ranker.parquet"), self.examples)
        elif require_ranker:
            raise TrainingSetError(
                f"{self.path}/ranker.parquet is missing (the ranker trains on Feast features)"
            )
        bad = (self.examples["user_row"] < 0) | (self.examples["user_row"] >= self.num_users)
        if bad.any():
            raise TrainingSetError(
                f"{int(bad.sum())} example(s) point at a user_row outside sequences.parquet"
            )
        too_long = self.examples["cut"].to_numpy() > self.seq_lengths[self.examples["user_row"].to_numpy()]
        if too_long.any():
            raise TrainingSetError(f"{int(too_long.sum())} example(s) have a cut beyond their user's history")
        self.raw_ids = {
            "user_id": self.examples["user_id"].to_numpy(np.int64).copy(),
            "ad_id": self.examples["ad_id"].to_numpy(np.int64).copy(),
            "seq_ad_id": self.seq_values["ad_id"].copy(),
        }
        self.vocabularies: dict[str, Vocabulary] = {}
        self._map_ids(load_vocabularies(self.path) if vocabularies is None else vocabularies)
        self.vocab = self._vocab()

    def _map_ids(self, vocabularies: dict[str, Vocabulary]) -> None:
        """Raw ``user_id`` / ``ad_id`` -> model rows (unknown -> OOV); a set without vocabularies keeps its ids
        as rows (sets built before vocabularies, and synthetic ones whose ids are already small)."""
        self.vocabularies = dict(vocabularies)
        v = self.vocabularies.get("user_id")  # ``user_id`` stays raw: splits and metrics group users by it
        self.examples[USER_VOCAB_ROW] = v.map(self.raw_ids["user_id"]) if v else self.raw_ids["user_id"]
        v = self.vocabularies.get("ad_id")
        self.examples["ad_id"] = v.map(self.raw_ids["ad_id"]) if v else self.raw_ids["ad_id"]
        self.seq_values["ad_id"] = v.map(self.raw_ids["seq_ad_id"]) if v else self.raw_ids["seq_ad_id"]

    def as_seen_by(self, vocabularies: dict[str, Vocabulary]) -> TrainingSet:
        """This set with its ids mapped by another model's vocabularies (a user model feeding the ranker)."""
        if not vocabularies or vocabularies is self.vocabularies:
            return self
        other = copy.copy(self)
        other.examples = self.examples.copy()
        other.seq_values = dict(self.seq_values)
        other._map_ids(vocabularies)
        return other

    def _load_sequences(self, table: pa.Table) -> None:
        missing = [f for f in HISTORY_FIELDS if f not in table.column_names]
        if missing:
            raise TrainingSetError(f"sequences.parquet lacks history column(s) {missing}")
        self.num_users = table.num_rows
        self.seq_values: dict[str, np.ndarray] = {}
        offsets = None
        for name in HISTORY_FIELDS:
            col = table.column(name).combine_chunks()
            if col.null_count:
                raise TrainingSetError(f"sequences.parquet column {name!r} has null lists")
            col_offsets = col.offsets.to_numpy().astype(np.int64)
            col_offsets = col_offsets - col_offsets[0]
            if offsets is not None and not np.array_equal(offsets, col_offsets):
                raise TrainingSetError(
                    f"sequences.parquet column {name!r} is not aligned with the other fields"
                )
            offsets = col_offsets
            self.seq_values[name] = col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        self.seq_offsets = offsets if offsets is not None else np.zeros(1, np.int64)
        self.seq_lengths = np.diff(self.seq_offsets)

    def _vocab(self) -> dict[str, int]:
        """Rows per table: the manifest's sizes, raised to what the data actually holds."""
        sizes = dict(self.manifest.get("vocab_sizes") or self.manifest.get("vocab") or {})
        seen = {
            "action": len(ACTIONS),
            "surface": len(SURFACES),
            "gender": len(GENDERS),
            "user_id": int(self.examples[USER_VOCAB_ROW].max()) + 1 if len(self.examples) else 1,
        }
        for f in ("ad_id", "category_id", "advertiser_id", "action", "surface"):
            if f in self.vocabularies:
                continue
            vals = [self.seq_values[f].max(initial=-1), self.examples[f].max() if f in self.examples else -1]
            seen[f] = max(seen.get(f, 0), int(max(vals)) + 1)
        if self.ranker is not None:
            for f in ("gender", "country"):
                col = profile_column(self.ranker, f)
                if col is not None and (~np.isnan(col)).any():
                    seen[f] = max(seen.get(f, 0), int(np.nanmax(col)) + 1)
        seen.setdefault("country", 1)
        for name, v in self.vocabularies.items():  # mapped ids: the table is the vocabulary
            seen[name] = v.size
        return {k: v if k in self.vocabularies else max(int(sizes.get(k, 0)), v, 1) for k, v in seen.items()}

    # ------------------------------------------------------------------------------------------- slicing
    def split_rows(self, split: str) -> np.ndarray:
        return np.flatnonzero(self.examples["split"].to_numpy() == split)

    def history(
        self,
        rows: np.ndarray,
        max_len: int,
        num_buckets: int,
        *,
        gap_to: str,
        cuts: np.ndarray | None = None,
        fresh_delay_s: int | None = None,
    ) -> Events:
        """Each example's events ``[max(0, cut - L), cut)``, flat, read at the example's time (``events_at``).
        ``cuts`` replaces the examples' own cuts (e.g. ``snapshot_cuts``: the history as of an earlier time)."""
        ex = self.examples
        cut = ex["cut"].to_numpy()[rows] if cuts is None else np.asarray(cuts, np.int64)
        return self.events_at(
            ex["user_row"].to_numpy()[rows], cut, ex["ts"].to_numpy()[rows], max_len, num_buckets,
            gap_to=gap_to, fresh_delay_s=fresh_delay_s,
        )  # fmt: skip

    def events_at(
        self,
        user_row: np.ndarray,
        cut: np.ndarray,
        request_ts: np.ndarray,
        max_len: int,
        num_buckets: int,
        *,
        gap_to: str,
        fresh_delay_s: int | None = None,
    ) -> Events:
        """The last ``max_len`` of each user's first ``cut`` events, as a model reads them at ``request_ts``.

        ``gap_to``: "previous" event (the user model: causal) or "request" time (the ranker: every event is
        older than the request). ``fresh_delay_s`` (the ranker): only the events the online store serves at
        ``request_ts`` (``fresh_cutoff``: older than the push path's latency budget), the rule serving applies
        to the store's list (``serving.inputs.recent_events``)."""
        user_row = np.asarray(user_row, np.int64)
        if fresh_delay_s is not None:
            cut = np.minimum(cut, self._events_before(user_row, fresh_cutoff(request_ts, fresh_delay_s)))
        base = self.seq_offsets[user_row]
        return self._events(base + np.maximum(0, cut - max_len), base + cut, num_buckets, gap_to, request_ts)

    def _events_before(self, user_row: np.ndarray, ts: np.ndarray) -> np.ndarray:
        """How many of each user's events happened strictly before ``ts`` (seconds)."""
        keys = self._user_time_keys()
        user_row = np.asarray(user_row, np.int64)
        found = np.searchsorted(keys, (user_row << 32) + np.maximum(ts, 0), side="left")
        return found - self.seq_offsets[user_row]

    def snapshot_cuts(self, rows: np.ndarray, every_s: int = DAY_S) -> np.ndarray:
        """Each example's cut as of the start of its ``every_s`` period (UTC days by default): how many of its
        user's events happened strictly before that boundary. This is the history a cache refreshed at the
        boundary holds (the daily user-embedding refresh); never later than the example's own cut."""
        ex = self.examples
        user_row = ex["user_row"].to_numpy(np.int64)[rows]
        ts = ex["ts"].to_numpy(np.int64)[rows]
        found = self._events_before(user_row, ts - np.mod(ts, every_s))
        return np.minimum(found, ex["cut"].to_numpy(np.int64)[rows])

    def _user_time_keys(self) -> np.ndarray:
        """(events,) sorted keys ``user_row << 32 | ts`` of every history event (sequences are time-sorted)."""
        if getattr(self, "_keys", None) is None:
            ts = self.seq_values["ts"]
            if len(ts) and (ts.min() < 0 or ts.max() >= 2**32):
                raise TrainingSetError("history timestamps must be seconds in [1970, 2106) for snapshots")
            user = np.repeat(np.arange(self.num_users, dtype=np.int64), self.seq_lengths)
            self._keys = (user << 32) + ts
        return self._keys

    def snapshot_groups(self, rows: np.ndarray, every_s: int = DAY_S) -> tuple[np.ndarray, np.ndarray]:
        """(group id per row, snapshot cut per row): rows of one user in one period share a group (and a cut)."""
        cuts = self.snapshot_cuts(rows, every_s)
        user_row = self.examples["user_row"].to_numpy(np.int64)[rows]
        _, group = np.unique(np.stack([user_row, cuts]), axis=1, return_inverse=True)
        return group.reshape(-1), cuts

    def _events(self, start, end, num_buckets, gap_to, request_ts) -> Events:
        lens = (end - start).astype(np.int64)
        offsets = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        idx = np.repeat(start - offsets[:-1], lens) + np.arange(offsets[-1])
        vals = {f: self.seq_values[f][idx] for f in HISTORY_FIELDS}
        if gap_to == "previous":
            gap = time_bucket(previous_gaps(vals["ts"], offsets), num_buckets)
        elif gap_to == "request":
            gap = time_bucket(np.repeat(request_ts, lens) - vals["ts"], num_buckets)
        else:
            raise ValueError(f"gap_to must be 'previous' or 'request', got {gap_to!r}")
        t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in vals.items()}
        return Events(**t, gap_bucket=torch.from_numpy(gap), offsets=torch.from_numpy(offsets))

    def candidates(self, rows: np.ndarray, dense: np.ndarray) -> Candidates:
        ex = self.examples
        t = {f: torch.from_numpy(ex[f].to_numpy(np.int64)[rows]) for f in CANDIDATE_ID_FIELDS}
        return Candidates(**t, dense=torch.from_numpy(dense[rows]), offsets=torch.arange(len(rows) + 1))

    def labels(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.examples[list(LABELS)].to_numpy(np.float32)[rows])

    def profile(self, rows: np.ndarray, age_dense: np.ndarray) -> Profile:
        src = self.ranker if self.ranker is not None else self.examples

        def ids(what: str) -> torch.Tensor:
            col = profile_column(src, what)
            if col is None:
                return torch.zeros(len(rows), dtype=torch.int64)
            return torch.from_numpy(np.nan_to_num(col[rows], nan=-1).astype(np.int64))  # missing -> OOV row

        return Profile(
            user_id=torch.from_numpy(self.examples[USER_VOCAB_ROW].to_numpy(np.int64)[rows]),
            gender=ids("gender"),
            country=ids("country"),
            dense=torch.from_numpy(age_dense[rows]),
        )

    def dense_columns(self) -> list[str]:
        """Numeric scalar feature columns of ranker.parquet (ad stats, attributes), else just ``quality``."""
        frame = self.ranker if self.ranker is not None else self.examples
        cols = [
            c
            for c in frame.columns
            if c not in NOT_DENSE
            and not c.endswith("_id")
            and pd.api.types.is_numeric_dtype(frame[c])
            and not pd.api.types.is_bool_dtype(frame[c])
        ]
        return cols or ["quality"]

    def dense_frame(self) -> pd.DataFrame:
        return self.ranker if self.ranker is not None else self.examples

    def user_embeddings(self) -> tuple[np.ndarray | None, np.ndarray, list[str]]:
        """(N, E) cached embeddings (zeros where null), the (N,) presence mask and the model versions seen."""
        if self.ranker is None or "user_embedding" not in self.ranker:
            return None, np.zeros(len(self.examples), bool), []
        col = self.ranker["user_embedding"]
        present = col.notna().to_numpy()
        if not present.any():
            return None, present, []
        dims = {len(v) for v in col[present]}
        if len(dims) != 1:
            raise TrainingSetError(f"user_embedding rows have different lengths {sorted(dims)}")
        (dim,) = dims
        emb = np.zeros((len(col), dim), np.float32)
        emb[present] = np.stack(col[present].to_numpy()).astype(np.float32)
        versions = (
            sorted(self.ranker.loc[present, "model_version"].dropna().unique().tolist())
            if "model_version" in self.ranker
            else []
        )
        return emb, present, versions


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _normalize_examples(ex: pd.DataFrame, path: Path) -> pd.DataFrame:
    missing = [c for c in (*EXAMPLE_COLUMNS, *LABELS, "split") if c not in ex]
    if missing:
        raise TrainingSetError(f"{path}/examples.parquet lacks column(s) {missing}")
    ex = ex.copy()
    if pd.api.types.is_datetime64_any_dtype(ex["ts"]):
        ex["ts"] = (
            ex["ts"].dt.tz_convert("UTC").astype("int64") // 10**9
            if ex["ts"].dt.tz
            else ex["ts"].astype("int64") // 10**9
        )
    if "quality" not in ex:
        ex["quality"] = 0.0
    for col in (*EXAMPLE_COLUMNS, *LABELS):
        if ex[col].isna().any():
            raise TrainingSetError(f"{path}/examples.parquet column {col!r} has nulls")
    ex["split"] = ex["split"].astype(str)
    return ex.reset_index(drop=True)


def _align_ranker(ranker: pd.DataFrame, examples: pd.DataFrame) -> pd.DataFrame:
    """ranker.parquet rows in examples.parquet's order (joined on example_id when both carry it)."""
    if "example_id" in ranker and "example_id" in examples:
        ranker = ranker.drop_duplicates("example_id").set_index("example_id")
        missing = ~examples["example_id"].isin(ranker.index)
        if missing.any():
            raise TrainingSetError(
                f"ranker.parquet lacks {int(missing.sum())} example(s) of examples.parquet"
            )
        return ranker.loc[examples["example_id"].to_numpy()].reset_index()
    if len(ranker) != len(examples):
        raise TrainingSetError("ranker.parquet and examples.parquet differ in rows and share no example_id")
    return ranker.reset_index(drop=True)
