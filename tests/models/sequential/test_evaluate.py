"""Leave-one-out ranking: the metric formulas, the fixed negative lists, sampled and full ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.sequential.data import SequenceSet
from models.sequential.evaluate import popularity_scorer, rank_split, sequence_negatives
from models.training.data import TrainingSet
from models.training.metrics import ranks_to_metrics


@pytest.fixture(scope="module")
def seqs(loo_set) -> SequenceSet:
    ws, name = loo_set
    return SequenceSet(TrainingSet(ws.training(name)), max_len=8, time_buckets=16)


def test_metric_formulas():
    m = ranks_to_metrics(np.array([0, 1, 4, 9, 10, 50]))
    assert m["hr@1"] == pytest.approx(1 / 6) and m["hr@5"] == pytest.approx(3 / 6)
    assert m["hr@10"] == pytest.approx(4 / 6)
    assert m["ndcg@10"] == pytest.approx((1 + 1 / np.log2(3) + 1 / np.log2(6) + 1 / np.log2(11)) / 6)
    assert m["mrr"] == pytest.approx(np.mean([1, 1 / 2, 1 / 5, 1 / 10, 1 / 11, 1 / 51]))


def test_negative_lists_are_fixed_and_never_touched(seqs):
    first = sequence_negatives(seqs, 20, seed=3)
    assert np.array_equal(first, sequence_negatives(seqs, 20, seed=3))
    assert not np.array_equal(first, sequence_negatives(seqs, 20, seed=4))
    for u in range(seqs.num_users):
        assert len(set(first[u])) == 20 and not set(first[u]) & set(seqs.seen_items(u).tolist())


def test_oracle_ranks_first_and_a_constant_scorer_last(seqs):
    negatives = sequence_negatives(seqs, 20, seed=0)
    num_items = seqs.data.vocab["ad_id"]

    def oracle(users, split):
        scores = torch.zeros(len(users), num_items)
        scores[torch.arange(len(users)), torch.from_numpy(seqs.targets(split)[users])] = 1.0
        return scores

    best = rank_split(oracle, seqs, "test", negatives, batch_users=7)
    assert best["hr@1"] == 1.0 and best["full_hr@1"] == 1.0 and best["mrr"] == 1.0
    tied = rank_split(lambda users, split: torch.zeros(len(users), num_items), seqs, "test", negatives)
    assert tied["hr@10"] == 0.0 and tied["full_hr@10"] == 0.0  # ties count against the model
    pop = rank_split(popularity_scorer(seqs), seqs, "valid", negatives, prefix="valid_")
    assert 0.0 <= pop["valid_hr@10"] <= 1.0 and pop["valid_users"] == seqs.num_users


def test_sampled_only_ranking_equals_the_sampled_part_of_the_full_one(seqs):
    """What training validates with between full rankings: each user's 1 + negatives items scored alone."""
    from models.inference.bundle import build_model
    from models.sequential.evaluate import model_scorer

    negatives = sequence_negatives(seqs, 20, seed=0)
    torch.manual_seed(0)
    sasrec = build_model("sasrec", _sasrec_config(), seqs.data.vocab, 0).eval()
    for scorer in (popularity_scorer(seqs), model_scorer(sasrec, seqs)):
        both = rank_split(scorer, seqs, "valid", negatives, prefix="valid_", batch_users=7)
        sampled = rank_split(scorer, seqs, "valid", negatives, prefix="valid_", batch_users=7, full=False)
        assert sampled == {k: v for k, v in both.items() if "full_" not in k}
        assert 0.0 < sampled["valid_hr@10"] < 1.0


def test_a_model_scorer_records_no_autograd_graph(seqs):
    """Ranking outside training (`gemflow evaluate`, the registry gate, the paired bench) runs with gradients
    on: a scorer whose scores carried graphs kept each batch's activations alive (~2 GB per Toys ranking)."""
    from models.inference.bundle import build_model
    from models.sequential.evaluate import model_scorer

    sasrec = build_model("sasrec", _sasrec_config(), seqs.data.vocab, 0).eval()
    assert torch.is_grad_enabled()
    score = model_scorer(sasrec, seqs)
    users = np.arange(min(4, seqs.num_users))
    negatives = torch.from_numpy(sequence_negatives(seqs, 5, seed=0)[users])
    for scores in (score(users, "valid"), score(users, "valid", negatives)):
        assert not scores.requires_grad and scores.grad_fn is None


def _sasrec_config():
    from models.config import SASRecConfig

    return SASRecConfig(d_model=16, num_blocks=1, num_heads=1, dropout=0.0, max_len=8)
