"""A leave-one-out training set seen as item sequences: training pairs, evaluation histories, item attributes.

Per user, the positives in time order are p_1 .. p_n (n >= 3): p_n is test, p_{n-1} valid, the rest train. A
positive's ``cut`` counts the user's history events before it, so the state at history position ``cut - 1``
(the last event the user had done) is the one that predicts it. One training example per user and epoch:
the history up to the valid positive (the longest train prefix, at most ``max_len`` events), with a
next-item target at every position that precedes a train positive. Positive-only logs have one history event
per positive, so this is SASRec's "every position predicts the next item"; logs with impressions of
non-positives predict the next *positive* from wherever the user was.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from features.vocabulary import Vocabulary
from models.architectures.transforms import lengths
from models.training.batch import Events
from models.training.data import USER_VOCAB_ROW, TrainingSet, TrainingSetError


@dataclass
class TrainPairs:
    """One batch of training sequences and their next-item targets."""

    history: Events
    user_id: torch.Tensor  # (B,)
    sources: torch.Tensor  # (P,) flat positions into ``history`` whose state predicts ...
    targets: torch.Tensor  # (P,) ... this ad id


@dataclass
class ItemAttributes:
    """Every attribute of every ad as a jagged list indexed by ad id (``items.parquet``); ad ids without a row
    (or beyond the table) get an empty list."""

    values: torch.Tensor  # (total,) attribute ids
    offsets: torch.Tensor  # (num_ads + 1,)
    category: torch.Tensor  # (num_ads,) the primary category of each ad (0 where unknown)
    advertiser: torch.Tensor  # (num_ads,) its advertiser / brand id (0 where unknown)

    @property
    def num_attributes(self) -> int:
        return int(self.values.max()) + 1 if self.values.numel() else 1

    @classmethod
    def read(cls, path: Path, num_ads: int, vocabulary: Vocabulary | None = None) -> ItemAttributes | None:
        """From a training set folder's ``items.parquet``, indexed by the rows of ``vocabulary`` (raw ad ids when
        there is none); None when the set has none (older sets)."""
        file = Path(path) / "items.parquet"
        if not file.exists():
            return None
        table = pq.read_table(file, columns=["ad_id", "category_id", "advertiser_id", "categories"])
        if len(np.unique(table.column("ad_id").to_numpy())) != table.num_rows:
            raise TrainingSetError(f"{file}: duplicate ad_id rows")
        if vocabulary is not None:
            rows = vocabulary.map(table.column("ad_id").to_numpy())
            table = table.set_column(0, "ad_id", pa.array(rows, pa.int64()))
            # hashed rows: the first ad of a bucket speaks for it
            first = np.unique(rows, return_index=True)[1]
            table = table.take(pa.array(np.sort(first)))
        table = table.sort_by("ad_id")
        ads = table.column("ad_id").to_numpy()
        keep = (ads >= 0) & (ads < num_ads)
        lists = table.column("categories").combine_chunks().filter(pa.array(keep))
        lengths = np.zeros(num_ads, np.int64)
        lengths[ads[keep]] = np.diff(lists.offsets.to_numpy())  # ads in id order: values line up
        offsets = np.zeros(num_ads + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = lists.flatten().to_numpy().astype(np.int64)
        per_ad = {}
        for name in ("category_id", "advertiser_id"):
            column = np.zeros(num_ads, np.int64)
            column[ads[keep]] = table.column(name).to_numpy()[keep]
            per_ad[name] = torch.from_numpy(column)
        return cls(
            torch.from_numpy(values),
            torch.from_numpy(offsets),
            per_ad["category_id"],
            per_ad["advertiser_id"],
        )

    def mean_matrix(self) -> torch.Tensor:
        """(num_ads, num_attributes) sparse CSR: row i averages ad i's attributes (an empty row: zeros)."""
        counts = lengths(self.offsets)
        weights = (1.0 / counts.clamp(min=1).float()).repeat_interleave(counts)
        rows = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        columns = torch.from_numpy(np.lexsort((self.values.numpy(), rows.numpy())))  # CSR: sorted per row
        shape = (self.offsets.numel() - 1, self.num_attributes)
        with warnings.catch_warnings():  # "sparse CSR support is in beta": CSR @ dense is all we use
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(
                self.offsets, self.values[columns], weights[columns], shape, check_invariants=True
            )

    def to_payload(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, "offsets": self.offsets, "category": self.category,
                "advertiser": self.advertiser}  # fmt: skip


class SequenceSet:
    """The leave-one-out view of a positive-only ``TrainingSet``: who is evaluated, and on which histories."""

    def __init__(self, data: TrainingSet, max_len: int, time_buckets: int):
        ex = data.examples
        split = ex["split"].to_numpy()
        if not {"train", "valid", "test"} <= set(np.unique(split)):
            raise TrainingSetError(
                f"{data.path}: the next-item objective needs a leave-one-out split (train, valid and test "
                "positives per user); build the set with --split leave-one-out"
            )
        self.data, self.max_len, self.time_buckets = data, max_len, time_buckets
        positive = ex["click"].to_numpy() > 0
        user_row = ex["user_row"].to_numpy(np.int64)
        # leave_one_out_split marks one valid and one test positive per eligible user; pair them by user
        valid = np.flatnonzero(positive & (split == "valid"))
        test = np.flatnonzero(positive & (split == "test"))
        self.valid_rows = valid[np.argsort(user_row[valid], kind="stable")]
        self.test_rows = test[np.argsort(user_row[test], kind="stable")]
        if not np.array_equal(user_row[self.valid_rows], user_row[self.test_rows]):
            raise TrainingSetError(f"{data.path}: valid and test positives are not one pair per user")
        self.user_rows = user_row[self.valid_rows]  # (U,) users with a train prefix, valid and test positive
        self.user_ids = ex[USER_VOCAB_ROW].to_numpy(np.int64)[self.valid_rows]  # rows of the user table
        # Train positives: the history position before each (cut - 1), grouped by the user's index.
        train = np.flatnonzero(positive & (split == "train"))
        cut = ex["cut"].to_numpy(np.int64)
        index_of_row = np.full(data.num_users, -1, np.int64)
        index_of_row[self.user_rows] = np.arange(len(self.user_rows))
        owner = index_of_row[user_row[train]]
        keep = (owner >= 0) & (cut[train] > 0)
        order = np.lexsort((cut[train][keep], owner[keep]))
        self.pair_user = owner[keep][order]
        self.pair_pos = cut[train][keep][order] - 1  # position in the user's full history
        self.pair_item = ex["ad_id"].to_numpy(np.int64)[train][keep][order]
        self.pair_offsets = np.searchsorted(self.pair_user, np.arange(len(self.user_rows) + 1))
        self.train_cut = cut[
            self.valid_rows
        ]  # the history a training sequence reads: up to the valid positive

    @property
    def num_users(self) -> int:
        return len(self.user_rows)

    def train_counts(self) -> np.ndarray:
        """(num_ads,) how often each ad is a train target (popularity)."""
        return np.bincount(self.pair_item, minlength=self.data.vocab["ad_id"])

    def train_batch(self, users: np.ndarray) -> TrainPairs:
        """The train prefixes of ``users`` (indices into this set), with their next-item targets."""
        rows = self.valid_rows[users]
        cuts = self.train_cut[users]
        history = self.data.history(rows, self.max_len, self.time_buckets, gap_to="previous", cuts=cuts)
        start = np.maximum(0, cuts - self.max_len)  # the window's first position in the full history
        lo, hi = self.pair_offsets[users], self.pair_offsets[users + 1]
        counts = hi - lo
        pick = np.repeat(lo - np.r_[0, np.cumsum(counts)[:-1]], counts) + np.arange(counts.sum())
        batch_index = np.repeat(np.arange(len(users)), counts)
        local = self.pair_pos[pick] - start[batch_index]
        inside = local >= 0  # targets whose source fell out of the window are dropped
        flat = history.offsets.numpy()[:-1][batch_index] + local
        return TrainPairs(
            history=history,
            user_id=torch.from_numpy(self.user_ids[users]),
            sources=torch.from_numpy(flat[inside]),
            targets=torch.from_numpy(self.pair_item[pick][inside]),
        )

    def eval_history(self, users: np.ndarray, split: str) -> tuple[Events, torch.Tensor]:
        """Histories as of the ``split`` positive ("valid": the train prefix; "test": it plus the valid item)."""
        rows = (self.valid_rows if split == "valid" else self.test_rows)[users]
        history = self.data.history(rows, self.max_len, self.time_buckets, gap_to="previous")
        return history, torch.from_numpy(self.user_ids[users])

    def history_lengths(self, split: str) -> np.ndarray:
        """(U,) how many events each user's ``split`` history holds (before the window of ``max_len``)."""
        rows = self.valid_rows if split == "valid" else self.test_rows
        return self.data.examples["cut"].to_numpy(np.int64)[rows]

    def targets(self, split: str) -> np.ndarray:
        rows = self.valid_rows if split == "valid" else self.test_rows
        return self.data.examples["ad_id"].to_numpy(np.int64)[rows]

    def history_items(self, users: np.ndarray, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, values): every item ``users`` had before their ``split`` positive, whole history (the
        items masked out of the full ranking)."""
        rows = (self.valid_rows if split == "valid" else self.test_rows)[users]
        d = self.data
        start = d.seq_offsets[self.user_rows[users]]
        cut = d.examples["cut"].to_numpy(np.int64)[rows]
        offsets = np.r_[0, np.cumsum(cut)]
        index = np.repeat(start - offsets[:-1], cut) + np.arange(offsets[-1])
        return offsets, d.seq_values["ad_id"][index]

    def seen_items(self, user: int) -> np.ndarray:
        """Every ad in the user's whole history (the protocol's negatives are ads the user never touched)."""
        u = self.user_rows[user]
        d = self.data
        return d.seq_values["ad_id"][d.seq_offsets[u] : d.seq_offsets[u + 1]]
