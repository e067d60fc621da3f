"""Leave-one-out ranking of a next-item model's held-out positive under the protocol of
``models.training.leave_one_out`` (stated there once): among the fixed sampled negatives, and against the whole
training catalog with the user's history masked (``full_``, the published convention) and unmasked
(``full_unmasked_``). Metrics: HR@{1,5,10}, NDCG@{1,5,10}, MRR (``models.training.metrics.ranks_to_metrics``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from models.sequential.data import SequenceSet
from models.training.leave_one_out import full_ranks, negative_lists, training_catalog
from models.training.metrics import ranks_to_metrics, sampled_ranks


def sequence_negatives(seqs: SequenceSet, num_negatives: int = 99, seed: int = 0) -> np.ndarray:
    """(users, num_negatives): the protocol's lists for the users of ``seqs``, in its user order."""
    return negative_lists(seqs.data, seqs.user_rows, num_negatives, seed)


def rank_split(
    score: Callable[..., torch.Tensor],
    seqs: SequenceSet,
    split: str,
    negatives: np.ndarray,
    *,
    batch_users: int = 1024,
    prefix: str = "",
    candidates: torch.Tensor | None = None,
    full: bool = True,
) -> dict[str, float]:
    """Sampled and full-catalog metrics of ``score(users, split) -> (len(users), num_items)`` scores.

    Keys: ``<prefix><metric>`` sampled, ``<prefix>full_<metric>`` full ranking with the user's history masked,
    ``<prefix>full_unmasked_<metric>`` without. ``candidates`` (num_items,) bool: the training catalog (computed
    from the set when None; pass it to save that work on every evaluation). ``full=False``: the sampled metrics
    alone, from ``score(users, split, items)`` on each user's 1 + negatives items (a model_scorer or
    popularity_scorer), skipping what scoring and ranking the whole catalog costs (~85% of a SASRec validation on
    Sports)."""
    ranks = split_ranks(
        score, seqs, split, negatives, batch_users=batch_users, candidates=candidates, full=full
    )
    out = {f"{prefix}users": float(seqs.num_users)}
    for protocol, ranked in ranks.items():
        out |= ranks_to_metrics(ranked, prefix=prefix + PROTOCOL_PREFIX[protocol])
    return out


PROTOCOL_PREFIX = {"sampled": "", "masked": "full_", "unmasked": "full_unmasked_"}  # metric key prefixes


def split_ranks(
    score: Callable[..., torch.Tensor],
    seqs: SequenceSet,
    split: str,
    negatives: np.ndarray,
    *,
    batch_users: int = 1024,
    candidates: torch.Tensor | None = None,
    full: bool = True,
) -> dict[str, np.ndarray]:
    """Each user's rank of the held-out item (0 = top), per protocol ("sampled", and with ``full`` "masked" and
    "unmasked"), in ``seqs``' user order: what ``rank_split`` averages, and what a paired comparison of two
    models over the same users reads (``bench/sequential_paired.py``)."""
    targets = torch.from_numpy(seqs.targets(split))
    negatives = torch.from_numpy(negatives)
    order = _by_history_length(seqs, split)
    sampled, masked, unmasked = [], [], []
    if full and candidates is None:
        candidates = catalog_mask(seqs)
    for start in range(0, seqs.num_users, batch_users):
        users = order[start : start + batch_users]
        if not full:
            scores = score(users, split, torch.cat([targets[users, None], negatives[users]], 1)).float()
            sampled.append(sampled_ranks(scores[:, 0], scores[:, 1:]))
            continue
        scores = score(users, split).float().contiguous()  # full_ranks counts in place: a scorer's own copy
        target = targets[users]
        known = (target >= 0) & (target < scores.shape[1])
        target = target.clamp(0, scores.shape[1] - 1)
        pos = scores.gather(1, target[:, None])[:, 0].masked_fill(~known, -torch.inf)  # never trained: a miss
        sampled.append(sampled_ranks(pos, scores.gather(1, negatives[users])))
        history = seqs.history_items(users, split)
        m, u = full_ranks(scores, target, pos, candidates[: scores.shape[1]], history)
        masked.append(m)
        unmasked.append(u)
    inverse = np.argsort(order)  # back from history-length order to the user order of ``seqs``
    ranks = {"sampled": sampled} | ({"masked": masked, "unmasked": unmasked} if full else {})
    return {protocol: torch.cat(parts).numpy()[inverse] for protocol, parts in ranks.items()}


def _by_history_length(seqs: SequenceSet, split: str) -> np.ndarray:
    """Users of similar history length together: a padded encoder (SASRec) then pads little (the metrics are
    means over users, so their order does not matter)."""
    return np.argsort(np.minimum(seqs.history_lengths(split), seqs.max_len), kind="stable")


def _pick(scores: torch.Tensor, items: torch.Tensor | None) -> torch.Tensor:
    """``scores`` (U, num_items) itself, or its (U, k) columns ``items``."""
    if items is None:
        return scores
    return _unknown_miss(scores.gather(1, items.clamp(0, scores.shape[1] - 1)), items, scores.shape[1])


def _unknown_miss(scores: torch.Tensor, items: torch.Tensor, num_items: int) -> torch.Tensor:
    """``scores`` (U, k) of ``items`` with the ids beyond a ``num_items`` table (never trained) at -inf: a miss."""
    return scores.masked_fill((items < 0) | (items >= num_items), -torch.inf)


def catalog_mask(seqs: SequenceSet) -> torch.Tensor:
    """(num_items,) True for the ads of the training catalog (the full ranking's candidates)."""
    mask = torch.zeros(seqs.data.vocab["ad_id"], dtype=torch.bool)
    mask[torch.from_numpy(training_catalog(seqs.data))] = True
    return mask


def popularity_scorer(seqs: SequenceSet) -> Callable[..., torch.Tensor]:
    """Scores = how often each item was a train positive (the same for every user); of ``items`` (U, k) alone
    when given."""
    counts = torch.from_numpy(seqs.train_counts().astype(np.float32))
    return lambda users, split, items=None: _pick(counts[None].expand(len(users), -1), items)


def model_scorer(model, seqs: SequenceSet) -> Callable[..., torch.Tensor]:
    """Scores of a sequential model: the query after each user's last event . every item vector, or . the
    vectors of ``items`` (U, k) alone when given (an id beyond the model's table scores -inf). Gradient-free
    wherever it is called: a scorer that recorded autograd graphs kept ~2 GB of them per Toys test ranking."""
    with torch.no_grad():
        vectors = model.item_vectors()

    @torch.no_grad()
    def score(users: np.ndarray, split: str, items: torch.Tensor | None = None) -> torch.Tensor:
        history, user_id = seqs.eval_history(users, split)
        states = model.sequence_states(history, user_id)
        last = (history.offsets[1:] - 1).clamp(min=0)
        query = model.query(states[last]) if len(states) else states.new_zeros(len(users), vectors.shape[1])
        query = torch.where(
            (history.lengths > 0)[:, None], query, torch.zeros_like(query)
        )  # no history: ties
        if items is None:
            return query @ vectors.T
        picked = vectors[items.clamp(0, len(vectors) - 1)]  # (U, k, d)
        return _unknown_miss(torch.bmm(picked, query[:, :, None])[:, :, 0], items, len(vectors))

    return score


def is_next_item(bundle) -> bool:
    """SASRec, or a user model trained with the next-item objective."""
    return bundle.kind == "sasrec" or getattr(bundle.cfg, "objective", "") == "next_item"


def next_item_metrics(bundle, data, split: str = "test", num_negatives: int = 99, seed: int = 0) -> dict:
    """Sampled and full leave-one-out metrics of a trained next-item ``bundle`` on ``split`` (valid | test)."""
    seqs = _sequences(bundle, data)
    return rank_split(
        model_scorer(bundle.model.eval(), seqs), seqs, split, sequence_negatives(seqs, num_negatives, seed)
    )


def next_item_ranks(bundle, data, split: str = "test", num_negatives: int = 99, seed: int = 0) -> dict:
    """``split_ranks`` of a trained next-item ``bundle``: each user's rank per protocol."""
    seqs = _sequences(bundle, data)
    return split_ranks(
        model_scorer(bundle.model.eval(), seqs), seqs, split, sequence_negatives(seqs, num_negatives, seed)
    )


def _sequences(bundle, data) -> SequenceSet:
    cfg = bundle.cfg
    max_len = cfg.max_len if bundle.kind == "sasrec" else cfg.max_history
    return SequenceSet(data, max_len, getattr(cfg, "time_buckets", 0))
