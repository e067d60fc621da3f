"""Example rows of a training set -> a model's ``Batch`` (history, candidates, labels, profile, user tokens)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from models.architectures.transforms import normalize_age
from models.training.batch import Batch
from models.training.data import SNAPSHOTS, TrainingSet, profile_column
from models.training.dense import DenseSpec


class BatchBuilder:
    """Turns example rows into a ``Batch``: the user model reads the long history (each event's gap to the one
    before it: causal, and the user embedding does not depend on when it is computed); the ranker reads the
    recent events (gaps to the request time) plus cached user tokens.

    ``snapshot="day"`` (user model): every example reads its user's history as of the start of its day, the
    history a daily embedding refresh holds, and each run of consecutive rows of one user-day becomes ONE
    history with many candidates (``candidates.offsets``), so a user-day is encoded once however many
    impressions it has. Order rows with ``epoch_order`` / ``grouped`` to make those runs long."""

    def __init__(
        self,
        data: TrainingSet,
        dense: DenseSpec,
        *,
        history_len: int,
        time_buckets: int,
        gap_to: str,
        user_embeddings: np.ndarray | None = None,
        user_present: np.ndarray | None = None,
        num_user_tokens: int = 0,
        snapshot: str = "example",
        fresh_delay_s: int | None = None,
        fresh_as_of_day: bool = False,
    ):
        if snapshot not in SNAPSHOTS:
            raise ValueError(f"snapshot must be one of {sorted(SNAPSHOTS)}, got {snapshot!r}")
        if SNAPSHOTS[snapshot] and user_embeddings is not None:
            raise ValueError("snapshot batches are for the user model; cached user tokens are per example")
        if fresh_delay_s is not None and gap_to != "request":
            raise ValueError("fresh_delay_s is the ranker's (gap_to='request'): what the online store serves")
        self.snapshot_every, self.fresh_delay_s = SNAPSHOTS[snapshot], fresh_delay_s
        # evaluation only: the ranker's fresh events as a daily-only online store holds them (the day's start)
        self.fresh_as_of_day = fresh_as_of_day
        self.data = data
        self.history_len, self.time_buckets, self.gap_to = history_len, time_buckets, gap_to
        self.dense = dense.apply(data.dense_frame())
        frame = data.dense_frame()
        age = profile_column(frame, "age")
        self.age = normalize_age(np.zeros(len(frame)) if age is None else age)
        self.user_embeddings, self.user_present, self.k = user_embeddings, user_present, num_user_tokens
        if user_embeddings is not None and (
            num_user_tokens < 1 or user_embeddings.shape[1] % num_user_tokens
        ):
            raise ValueError(
                f"cached user embeddings of width {user_embeddings.shape[1]} do not split into "
                f"{num_user_tokens} tokens (ranker.num_user_tokens)"
            )

    def grouped(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` reordered so each snapshot group is contiguous (identity without snapshots)."""
        if not self.snapshot_every:
            return rows
        group, _ = self.data.snapshot_groups(rows, self.snapshot_every)
        return rows[np.argsort(group, kind="stable")]

    def epoch_order(self, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A shuffled training order: rows, or whole snapshot groups (rows of a group stay together)."""
        if not self.snapshot_every:
            return rng.permutation(rows)
        group, _ = self.data.snapshot_groups(rows, self.snapshot_every)
        rank = rng.permutation(group.max() + 1 if len(group) else 0)[group]
        return rows[np.argsort(rank, kind="stable")]

    def __call__(self, rows: np.ndarray) -> Batch:
        if self.snapshot_every:
            return self._snapshot_batch(rows)
        d = self.data
        batch = Batch(
            history=d.history(
                rows,
                self.history_len,
                self.time_buckets,
                gap_to=self.gap_to,
                cuts=d.snapshot_cuts(rows) if self.fresh_as_of_day else None,
                fresh_delay_s=self.fresh_delay_s,
            ),
            candidates=d.candidates(rows, self.dense),
            labels=d.labels(rows),
            profile=d.profile(rows, self.age),
        )
        if self.user_embeddings is not None:
            emb = self.user_embeddings[rows]
            batch.user_tokens = torch.from_numpy(emb.reshape(len(rows), self.k, -1))
            batch.user_token_mask = torch.from_numpy(self.user_present[rows])
        return batch

    def _snapshot_batch(self, rows: np.ndarray) -> Batch:
        d = self.data
        group, cuts = d.snapshot_groups(rows, self.snapshot_every)
        first = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])  # runs of consecutive rows
        offsets = torch.from_numpy(np.r_[first, len(rows)].astype(np.int64))
        head = rows[first]
        candidates = replace(d.candidates(rows, self.dense), offsets=offsets)
        return Batch(
            history=d.history(
                head, self.history_len, self.time_buckets, gap_to=self.gap_to, cuts=cuts[first]
            ),
            candidates=candidates,
            labels=d.labels(rows),
            profile=d.profile(head, self.age),
        )
