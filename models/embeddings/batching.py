"""Token-budget batches for inference: users sorted by history length, packed until the budget is spent.

Sorting makes each batch hold sequences of similar length, so the jagged attention's per-length buckets are
dense; the budget (sum of history lengths) keeps every batch about the same amount of work whether it holds
eight 4,000-event users or four hundred 80-event ones.
"""

from __future__ import annotations

import numpy as np


def token_budget_batches(lengths: np.ndarray, token_budget: int, max_users: int) -> list[np.ndarray]:
    """Row indices per batch (ascending length). A user longer than the budget gets a batch of its own."""
    if token_budget < 1 or max_users < 1:
        raise ValueError(f"token_budget and max_users must be >= 1, got {token_budget}, {max_users}")
    lengths = np.asarray(lengths, np.int64)
    order = np.argsort(lengths, kind="stable")
    batches: list[np.ndarray] = []
    start, spent = 0, 0
    for i, row in enumerate(order):
        cost = max(int(lengths[row]), 1)
        if i > start and (spent + cost > token_budget or i - start >= max_users):
            batches.append(order[start:i])
            start, spent = i, 0
        spent += cost
    if start < len(order):
        batches.append(order[start:])
    return batches


def shard_by_tokens(lengths: np.ndarray, shards: int) -> list[np.ndarray]:
    """Split rows into ``shards`` parts of near-equal total length (largest first, to the lightest part)."""
    lengths = np.asarray(lengths, np.int64)
    parts: list[list[int]] = [[] for _ in range(shards)]
    load = np.zeros(shards, np.int64)
    for row in np.argsort(-lengths, kind="stable"):
        k = int(np.argmin(load))
        parts[k].append(int(row))
        load[k] += max(int(lengths[row]), 1)
    return [np.sort(np.array(p, np.int64)) for p in parts]
