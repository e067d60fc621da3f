"""Leave-one-out ranking of the held-out positive: among 99 sampled items, and among every item.

Sampled: per user, ``num_negatives`` items the user never touched (anywhere in their history), drawn
uniformly with a fixed seed, so every model ranks the same lists (the SASRec / S3-Rec protocol). Full: the
held-out item against the whole catalog, nothing excluded. Ties count against the model (a constant scorer
cannot look good). Metrics: HR@{1,5,10}, NDCG@{5,10}, MRR.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from models.sequential.data import SequenceSet

KS = (1, 5, 10)


def negative_lists(seqs: SequenceSet, num_negatives: int = 99, seed: int = 0) -> np.ndarray:
    """(users, num_negatives) items each user never touched; the same for every model (fixed seed)."""
    catalog = np.unique(seqs.data.seq_values["ad_id"])
    catalog = catalog[catalog >= 0]  # OOV (-1): ads the training period never saw are nobody's negative
    if len(catalog) <= num_negatives:
        raise ValueError(f"leave-one-out needs more than {num_negatives} items, the set has {len(catalog)}")
    rng = np.random.default_rng(seed)
    out = np.empty((seqs.num_users, num_negatives), np.int64)
    for u in range(seqs.num_users):
        seen = np.unique(seqs.seen_items(u))
        picked = np.empty(0, np.int64)
        while len(picked) < num_negatives:  # rejection sampling: users touch a tiny part of the catalog
            draw = catalog[rng.integers(0, len(catalog), 2 * num_negatives)]
            draw = np.unique(draw[~np.isin(draw, seen)])
            picked = np.union1d(picked, draw) if len(picked) else draw
        out[u] = rng.permutation(picked)[:num_negatives]
    return out


def ranks_to_metrics(rank: np.ndarray, prefix: str = "") -> dict[str, float]:
    """``rank`` = how many candidates scored >= the positive (0 = top)."""
    rank = np.asarray(rank, np.float64)
    out = {f"{prefix}mrr": float(np.mean(1.0 / (rank + 1)))}
    for k in KS:
        hit = rank < k
        out[f"{prefix}hr@{k}"] = float(hit.mean())
        if k > 1:
            out[f"{prefix}ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(rank + 2), 0.0).mean())
    return out


def rank_split(
    score: Callable[[np.ndarray, str], torch.Tensor],
    seqs: SequenceSet,
    split: str,
    negatives: np.ndarray,
    *,
    batch_users: int = 1024,
    prefix: str = "",
) -> dict[str, float]:
    """Sampled and full-catalog metrics of ``score(users, split) -> (len(users), num_items)`` scores.

    Keys: ``<prefix><metric>`` for the sampled protocol, ``<prefix>full_<metric>`` for full ranking."""
    targets = torch.from_numpy(seqs.targets(split))
    negatives = torch.from_numpy(negatives)
    sampled, full = [], []
    for start in range(0, seqs.num_users, batch_users):
        users = np.arange(start, min(start + batch_users, seqs.num_users))
        scores = score(users, split).float()
        target = targets[users]
        # a held-out ad the training period never saw (OOV, -1) cannot be ranked by any model: a miss
        unknown = target < 0
        pos = scores.gather(1, target.clamp(min=0)[:, None])
        sampled.append(
            torch.where(unknown, negatives.shape[1], (scores.gather(1, negatives[users]) >= pos).sum(1))
        )
        full.append(
            torch.where(unknown, scores.shape[1], (scores >= pos).sum(1) - 1)
        )  # the target: no competitor
    return {
        **ranks_to_metrics(torch.cat(sampled).numpy(), prefix),
        **ranks_to_metrics(torch.cat(full).numpy(), f"{prefix}full_"),
        f"{prefix}users": float(seqs.num_users),
    }


def popularity_scorer(seqs: SequenceSet) -> Callable[[np.ndarray, str], torch.Tensor]:
    """Scores = how often each item was a train positive (the same for every user)."""
    counts = torch.from_numpy(seqs.train_counts().astype(np.float32))
    return lambda users, split: counts[None].expand(len(users), -1)


@torch.no_grad()
def model_scorer(model, seqs: SequenceSet) -> Callable[[np.ndarray, str], torch.Tensor]:
    """Scores of a sequential model: the query after each user's last event . every item vector."""
    items = model.item_vectors()

    def score(users: np.ndarray, split: str) -> torch.Tensor:
        history, user_id = seqs.eval_history(users, split)
        states = model.sequence_states(history, user_id)
        last = (history.offsets[1:] - 1).clamp(min=0)
        query = model.query(states[last]) if len(states) else states.new_zeros(len(users), items.shape[1])
        query = torch.where(
            (history.lengths > 0)[:, None], query, torch.zeros_like(query)
        )  # no history: ties
        return query @ items.T

    return score


def is_next_item(bundle) -> bool:
    """SASRec, or a user model trained with the next-item objective."""
    return bundle.kind == "sasrec" or getattr(bundle.cfg, "objective", "") == "next_item"


def next_item_metrics(bundle, data, split: str = "test", num_negatives: int = 99, seed: int = 0) -> dict:
    """Sampled and full leave-one-out metrics of a trained next-item ``bundle`` on ``split`` (valid | test)."""
    cfg = bundle.cfg
    max_len = cfg.max_len if bundle.kind == "sasrec" else cfg.max_history
    seqs = SequenceSet(data, max_len, getattr(cfg, "time_buckets", 0))
    return rank_split(
        model_scorer(bundle.model.eval(), seqs), seqs, split, negative_lists(seqs, num_negatives, seed)
    )
