"""The paired comparison over test users (bench/sequential_paired.py) and the per-user ranks it reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.sequential_paired import paired_bootstrap
from models.sequential.data import SequenceSet
from models.sequential.evaluate import popularity_scorer, rank_split, sequence_negatives, split_ranks
from models.training.data import TrainingSet
from models.training.metrics import per_user_metric, ranks_to_metrics


def test_per_user_values_average_to_the_table_metrics():
    ranks = np.array([0, 1, 4, 9, 10, 50])
    table = ranks_to_metrics(ranks)
    for metric in ("hr@10", "ndcg@10", "mrr"):
        assert per_user_metric(ranks, metric).mean() == pytest.approx(table[metric])
    assert per_user_metric(ranks, "ndcg@10")[1] == pytest.approx(1 / np.log2(3))


def test_paired_bootstrap_by_hand():
    # ours hits 3 of 4 users, theirs 1: per-user differences (+1, +1, 0, 0) in both seeds
    ours, theirs = np.array([0, 2, 5, 30]), np.array([20, 40, 5, 30])
    out = paired_bootstrap([ours, ours], [theirs, theirs], "hr@10", samples=500)
    assert out["diff"] == pytest.approx(0.5) and out["users"] == 4
    assert 0.0 <= out["low"] <= 0.5 <= out["high"] <= 1.0
    # a difference in half the seeds counts half; equal models are not ahead in any resample
    half = paired_bootstrap([ours, theirs], [theirs, theirs], "hr@10", samples=500)
    assert half["diff"] == pytest.approx(0.25)
    same = paired_bootstrap([ours], [ours], "ndcg@10", samples=100)
    assert same["diff"] == same["low"] == same["high"] == 0.0 and same["p_not_ahead"] == 1.0
    # a large consistent gap: the interval excludes 0
    rng = np.random.default_rng(0)
    good, bad = rng.integers(0, 10, 2000), rng.integers(0, 40, 2000)
    clear = paired_bootstrap([good], [bad], "hr@10")
    assert clear["low"] > 0 and clear["p_not_ahead"] == 0.0
    with pytest.raises(ValueError, match="same users"):
        paired_bootstrap([ours], [theirs[:3]], "hr@10")


def test_split_ranks_are_per_user_in_the_set_order(loo_set):
    """``rank_split``'s metrics are the means of ``split_ranks``; each rank belongs to its own user (the
    ranking runs in history-length order and is mapped back)."""
    ws, name = loo_set
    seqs = SequenceSet(TrainingSet(ws.training(name)), max_len=8, time_buckets=16)
    negatives = sequence_negatives(seqs, 20, seed=0)
    num_items = seqs.data.vocab["ad_id"]
    targets = torch.from_numpy(seqs.targets("test"))

    def target_first_for_even_users(users, split):
        scores = torch.zeros(len(users), num_items)
        even = torch.from_numpy(users % 2 == 0)
        scores[torch.arange(len(users))[even], targets[users][even]] = 1.0
        return scores

    ranks = split_ranks(target_first_for_even_users, seqs, "test", negatives, batch_users=7)
    users = np.arange(seqs.num_users)
    assert (ranks["masked"][users % 2 == 0] == 0).all() and (ranks["masked"][users % 2 == 1] > 0).all()
    pop = popularity_scorer(seqs)
    metrics = rank_split(pop, seqs, "test", negatives, batch_users=7)
    ranked = split_ranks(pop, seqs, "test", negatives, batch_users=7)
    assert ranks_to_metrics(ranked["masked"], prefix="full_")["full_hr@10"] == metrics["full_hr@10"]
    assert ranks_to_metrics(ranked["sampled"])["ndcg@10"] == metrics["ndcg@10"]
