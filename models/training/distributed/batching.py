"""Batches built to a token budget, split across ranks with equal tokens (jagged load balance).

A user-model example costs its history length (clipped to ``max_history``) plus one (its candidate / summary
work), so a batch of 8 long histories and a batch of 500 short ones can cost the same. A fixed user count per
rank would leave the rank with the long histories computing while the others wait at the gradient all-reduce.

``plan_epoch`` walks the epoch's shuffled rows, closes a step once its examples reach ``tokens_per_step``, then
splits that step's examples across ranks with the longest-processing-time rule (largest first, each to the
rank with the fewest tokens so far). Every rank computes the same plan from the same seed, so no message is
needed to agree on it, and every rank sees the same number of steps.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Step:
    """One optimizer step: the example rows of each rank and their token counts."""

    rows: list[np.ndarray]  # per rank, example row ids
    tokens: list[int]  # per rank, sum of example costs

    @property
    def imbalance(self) -> float:
        """max / mean tokens across ranks (1.0 = perfectly balanced)."""
        mean = sum(self.tokens) / len(self.tokens)
        return max(self.tokens) / mean if mean else 1.0


def example_costs(history_lengths: np.ndarray, max_history: int) -> np.ndarray:
    """Tokens each example costs: its (clipped) history length plus one."""
    return np.minimum(np.asarray(history_lengths, np.int64), max_history) + 1


def split_balanced(rows: np.ndarray, costs: np.ndarray, world_size: int) -> Step:
    """Split ``rows`` (with per-row ``costs``) into ``world_size`` parts with near-equal total cost."""
    if len(rows) < world_size:
        raise ValueError(f"cannot split {len(rows)} example(s) across {world_size} ranks")
    order = np.argsort(-costs, kind="stable")
    heap = [(0, r) for r in range(world_size)]  # (tokens so far, rank): the lightest rank pops first
    parts: list[list[int]] = [[] for _ in range(world_size)]
    tokens = [0] * world_size
    for i in order:
        load, rank = heapq.heappop(heap)
        parts[rank].append(int(i))
        tokens[rank] = load + int(costs[i])
        heapq.heappush(heap, (tokens[rank], rank))
    # an empty rank cannot run the collective forward: move one example from the rank with the most
    for rank in range(world_size):
        if not parts[rank]:
            donor = max(range(world_size), key=lambda r: len(parts[r]))
            moved = parts[donor].pop()
            parts[rank].append(moved)
            tokens[donor] -= int(costs[moved])
            tokens[rank] += int(costs[moved])
    # keep each rank's examples in their original (shuffled) order: the plan is then easy to read and log
    return Step([rows[np.sort(np.array(p, np.int64))] for p in parts], tokens)


def plan_epoch(
    rows: np.ndarray,
    costs: np.ndarray,
    *,
    tokens_per_step: int,
    world_size: int,
    seed: int,
    epoch: int,
) -> tuple[list[Step], int]:
    """The epoch's steps, and how many trailing examples were left out (too few to give every rank one).

    ``costs[i]`` is the cost of ``rows[i]``. The order is a permutation fixed by ``seed + epoch``, so a resumed
    run replays exactly the same steps.
    """
    if len(rows) != len(costs):
        raise ValueError(f"rows ({len(rows)}) and costs ({len(costs)}) differ in length")
    if tokens_per_step < world_size:
        raise ValueError(f"tokens_per_step={tokens_per_step} is below world_size={world_size}")
    perm = np.random.default_rng(seed + epoch).permutation(len(rows))
    rows, costs = np.asarray(rows)[perm], np.asarray(costs)[perm]
    # step boundaries: close a step once its running cost reaches the budget
    ends, total, start = [], 0, 0
    for i, c in enumerate(costs):
        total += int(c)
        if total >= tokens_per_step and i + 1 - start >= world_size:
            ends.append(i + 1)
            start, total = i + 1, 0
    leftover = len(rows) - start
    if leftover >= world_size:  # a short last step still trains, as long as every rank gets an example
        ends.append(len(rows))
        leftover = 0
    steps, begin = [], 0
    for end in ends:
        steps.append(split_balanced(rows[begin:end], costs[begin:end], world_size))
        begin = end
    return steps, leftover
