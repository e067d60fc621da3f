"""The leave-one-out ranking protocol, stated once: every command and bench ranks with these functions.

Per user, the positives in time order are p_1 .. p_n (n >= 3): p_n is test, p_{n-1} valid, the rest train
(``features.splits.leave_one_out_split``). The held-out positive is ranked two ways:

- **sampled**: against ``num_negatives`` items the user never touched (no history event, no example row),
  drawn uniformly from the training catalog with a generator seeded by (seed, user row): every model, command
  and split ranks the same lists, whatever order the users come in (the SASRec / S3-Rec protocol);
- **full**: against every item of the training catalog, reported *masked* (the items the user had before the
  held-out one are no competitors: the convention of the published full-ranking figures, the default in
  tables) and *unmasked* (they compete).

The training catalog is the set of ads of train rows: an id never seen in training is no candidate (its
embedding is its initialisation). A held-out item outside the trained vocabulary (id -1: an item that only
ever was some user's valid or test item; 379 of Toys' 38,824 held-out items) is a miss for every model: its
score is -inf, so every competitor ties or beats it, and its user still counts. The held-out item itself is
never its own competitor. Ties count against the model (rank = how many competitors score >= the positive), so a constant scorer ranks last. The metrics of a
rank are ``models.training.metrics.ranks_to_metrics``.
"""

from __future__ import annotations

import numpy as np
import torch

from features.splits import leave_one_out_split
from models.training.data import TrainingSet
from models.training.metrics import ranks_to_metrics, sampled_ranks  # noqa: F401  (the protocol's metrics)


def training_catalog(data: TrainingSet) -> np.ndarray:
    """Sorted ad ids of the train rows (positives) of the leave-one-out split."""
    ex = data.examples
    train = (leave_one_out_split(ex) == "train") & (ex["click"].to_numpy() > 0)
    ads = np.unique(ex["ad_id"].to_numpy(np.int64)[train])
    return ads[ads >= 0]  # -1: out of the vocabulary


def touched_items(data: TrainingSet, user_rows: np.ndarray) -> list[np.ndarray]:
    """Sorted ad ids each of ``user_rows`` touched anywhere: its history events and its example rows."""
    ex = data.examples
    owner = ex["user_row"].to_numpy(np.int64)
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.r_[user_rows, user_rows + 1].reshape(2, -1))
    ads = ex["ad_id"].to_numpy(np.int64)[order]
    history = data.seq_values["ad_id"]
    out = []
    for u, lo, hi in zip(user_rows.tolist(), bounds[0].tolist(), bounds[1].tolist(), strict=True):
        events = history[data.seq_offsets[u] : data.seq_offsets[u + 1]]
        out.append(np.union1d(events, ads[lo:hi]))
    return out


def negative_lists(
    data: TrainingSet, user_rows: np.ndarray, num_negatives: int = 99, seed: int = 0
) -> np.ndarray:
    """(len(user_rows), num_negatives) training-catalog items each user never touched, in draw order."""
    user_rows = np.asarray(user_rows, np.int64)
    catalog = training_catalog(data)
    out = np.empty((len(user_rows), num_negatives), np.int64)
    for i, (u, seen) in enumerate(zip(user_rows.tolist(), touched_items(data, user_rows), strict=True)):
        out[i] = _never_touched(np.random.default_rng([seed, u]), catalog, seen, num_negatives, u)
    return out


def _never_touched(rng, catalog: np.ndarray, seen: np.ndarray, n: int, user_row: int) -> np.ndarray:
    free = len(catalog) - int(np.isin(seen, catalog).sum())
    if free < n:
        raise ValueError(
            f"leave-one-out needs {n} negatives per user; user row {user_row} left {free} untouched items of the "
            f"{len(catalog)}-item training catalog (lower the number of negatives)"
        )
    if free < 4 * n:  # a small pool: draw from it exactly
        return rng.choice(catalog[~np.isin(catalog, seen)], n, replace=False)
    picked = np.empty(0, np.int64)
    while len(picked) < n:  # rejection sampling: a user touches a tiny part of the catalog
        draw = catalog[rng.integers(0, len(catalog), 2 * n)]
        draw = draw[~np.isin(draw, seen) & ~np.isin(draw, picked)]
        first = np.sort(np.unique(draw, return_index=True)[1])  # distinct, in draw order
        picked = np.concatenate([picked, draw[first]])
    return picked[:n]


def full_ranks(
    scores: torch.Tensor,
    target: torch.Tensor,
    pos: torch.Tensor,
    candidates: torch.Tensor,
    history: tuple[np.ndarray, np.ndarray],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked, unmasked) ranks of the held-out item ``target``, scored ``pos`` (U,), among ``scores`` (U, items).

    ``candidates`` (items,) marks the training catalog, ``history`` (offsets, values) the items each user had
    before the held-out one, jagged (masked out as competitors); the target is never its own competitor.

    Overwrites ``scores``: the catalog is counted by one in-place pass (``ge_``, NaN never counts) with no
    (users, items) temporaries; comparing into new bool/float masks cost ~20x more (~220 vs ~10 ms for 1,024
    users x 18k items at 1 thread), more than the scoring matmul itself. The history's competitors are read
    first, per (user, item) pair."""
    n, num_items = scores.shape
    offsets, values = history
    users = torch.from_numpy(np.repeat(np.arange(n), np.diff(offsets)))
    items = torch.from_numpy(np.asarray(values, np.int64))
    known = (items >= 0) & (items < num_items)
    users, items = users[known], items[known]
    competing = candidates[items] & (items != target[users])
    pairs = torch.unique(users[competing] * num_items + items[competing])  # an item seen twice masks once
    users, items = pairs // num_items, pairs % num_items
    history_beats = torch.bincount(users[scores[users, items] >= pos[users]], minlength=n)
    scores[torch.arange(n), target] = torch.nan
    scores.index_fill_(1, (~candidates).nonzero().squeeze(1), torch.nan)
    unmasked = scores.ge_(pos[:, None]).sum(1).long()
    return unmasked - history_beats, unmasked
