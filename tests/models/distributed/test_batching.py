"""Token-budget batches: every rank gets (nearly) the same number of history tokens, whatever the lengths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.training.distributed.batching import example_costs, plan_epoch, split_balanced


def heavy_tailed_costs(n: int, seed: int = 0) -> np.ndarray:
    """History lengths spanning orders of magnitude (most users short, a few very long)."""
    lengths = np.random.default_rng(seed).lognormal(mean=3.0, sigma=1.3, size=n).astype(np.int64)
    return example_costs(lengths, max_history=4096)


def test_steps_balance_tokens_across_ranks_with_heavy_tailed_histories():
    costs = heavy_tailed_costs(3000)
    rows = np.arange(3000) + 10_000
    steps, left_out = plan_epoch(rows, costs, tokens_per_step=20_000, world_size=4, seed=0, epoch=1)
    assert left_out == 0
    imbalance = [s.imbalance for s in steps[:-1]]  # the last step may be short
    assert max(imbalance) < 1.15, imbalance
    # a fixed count per rank would be far worse on the same data
    by_count = []
    for s in steps[:-1]:
        flat = np.concatenate(s.rows)
        tokens = [costs[flat[r::4] - 10_000].sum() for r in range(4)]
        by_count.append(max(tokens) / np.mean(tokens))
    assert np.mean(by_count) > np.mean(imbalance) + 0.1


def test_every_example_is_used_once_and_each_step_meets_the_budget():
    costs = heavy_tailed_costs(500, seed=1)
    rows = np.arange(500)
    steps, left_out = plan_epoch(rows, costs, tokens_per_step=3000, world_size=2, seed=3, epoch=2)
    used = np.concatenate([r for s in steps for r in s.rows])
    assert len(used) + left_out == 500 and len(np.unique(used)) == len(used)
    for s in steps:
        assert sum(s.tokens) == costs[np.concatenate(s.rows)].sum()
    assert all(sum(s.tokens) >= 3000 for s in steps[:-1])


def test_plan_is_a_function_of_seed_and_epoch_and_step_boundaries_do_not_depend_on_world_size():
    costs = heavy_tailed_costs(400, seed=2)
    rows = np.arange(400)
    a, _ = plan_epoch(rows, costs, tokens_per_step=2500, world_size=2, seed=5, epoch=1)
    b, _ = plan_epoch(rows, costs, tokens_per_step=2500, world_size=2, seed=5, epoch=1)
    c, _ = plan_epoch(rows, costs, tokens_per_step=2500, world_size=2, seed=5, epoch=2)
    one, _ = plan_epoch(rows, costs, tokens_per_step=2500, world_size=1, seed=5, epoch=1)
    assert all(
        np.array_equal(x, y) for s, t in zip(a, b, strict=True) for x, y in zip(s.rows, t.rows, strict=True)
    )
    assert not np.array_equal(np.concatenate(a[0].rows), np.concatenate(c[0].rows))
    # the same global batches whether one rank or two process them (same data per step, same step count)
    assert [set(np.concatenate(s.rows)) for s in a] == [set(s.rows[0]) for s in one]


def test_costs_are_clipped_history_lengths_plus_one():
    assert example_costs(np.array([0, 5, 9000]), max_history=512).tolist() == [1, 6, 513]


def test_too_few_examples_for_the_ranks_is_an_error_naming_the_counts():
    with pytest.raises(ValueError, match="cannot split 1 example"):
        split_balanced(np.array([3]), np.array([10]), world_size=2)
    with pytest.raises(ValueError, match="tokens_per_step=1 is below world_size=2"):
        plan_epoch(np.arange(4), np.ones(4, np.int64), tokens_per_step=1, world_size=2, seed=0, epoch=1)


def test_trailing_examples_too_few_for_every_rank_are_reported():
    steps, left_out = plan_epoch(
        np.arange(9), np.full(9, 10), tokens_per_step=40, world_size=4, seed=0, epoch=1
    )
    assert left_out == 1 and sum(len(r) for s in steps for r in s.rows) == 8


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(1, 5000), min_size=4, max_size=200),
    world=st.integers(1, 8),
)
def test_greedy_split_is_within_one_example_of_the_mean(costs, world):
    costs = np.array(costs)
    if len(costs) < world:
        return
    step = split_balanced(np.arange(len(costs)), costs, world)
    assert sorted(np.concatenate(step.rows).tolist()) == list(range(len(costs)))
    assert all(len(r) >= 1 for r in step.rows)
    # longest-processing-time bound: no rank exceeds the mean by more than the largest single example
    assert max(step.tokens) <= costs.sum() / world + costs.max()
