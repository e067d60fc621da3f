"""The one leave-one-out protocol: ranks, masking and ties on a hand-checked example, and the same negative
lists for every command and bench."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gemflow.config import load_config
from models.config import TrainRunConfig
from models.sequential.data import SequenceSet
from models.sequential.evaluate import rank_split, sequence_negatives
from models.sequential.task import NextItemTask
from models.training.data import TrainingSet
from models.training.evaluate import loo_lists
from models.training.leave_one_out import full_ranks, training_catalog
from models.training.metrics import ranks_to_metrics, sampled_ranks


def test_full_ranking_masked_and_unmasked_by_hand():
    # items 0..4 were seen in training, item 5 never was (no candidate, however high it scores)
    candidates = torch.tensor([True, True, True, True, True, False])
    scores = torch.tensor([[0.9, 0.5, 0.7, 0.5, 0.1, 0.99], [0.2, 0.2, 0.2, 0.2, 0.2, 0.2]])
    target = torch.tensor([1, 4])
    # user 0 had {0, 2} (item 0 twice: it masks once), user 1 had {1}
    history = (np.array([0, 3, 4]), np.array([0, 2, 0, 1]))
    pos = scores.gather(1, target[:, None])[:, 0]
    masked, unmasked = full_ranks(scores.clone(), target, pos, candidates, history)
    # user 0: 0 (0.9), 2 (0.7) and 3 (0.5, a tie) beat item 1; masked, only the tie is left
    # user 1: every candidate ties (ties count against the model); masked, item 1 is no competitor
    assert masked.tolist() == [1, 3] and unmasked.tolist() == [3, 4]
    # a held-out item the model never trained (scored -inf) is a miss: every candidate beats it
    missed = full_ranks(scores.clone(), target, torch.full((2,), -torch.inf), candidates, history)
    assert [r.tolist() for r in missed] == [[2, 3], [4, 4]]
    m = ranks_to_metrics(masked.numpy(), ks=(1, 5))
    assert m["hr@1"] == 0.0 and m["hr@5"] == 1.0
    assert m["ndcg@5"] == pytest.approx((1 / np.log2(3) + 1 / np.log2(5)) / 2)
    assert m["mrr"] == pytest.approx((1 / 2 + 1 / 4) / 2)
    assert ranks_to_metrics(unmasked.numpy(), ks=(1,))["mrr"] == pytest.approx((1 / 4 + 1 / 5) / 2)
    # sampled: the positive 0.5 against 0.5 (a tie), 0.4 and 0.6 -> rank 2
    assert sampled_ranks(torch.tensor([0.5]), torch.tensor([[0.5, 0.4, 0.6]])).tolist() == [2]


def test_full_ranks_equal_a_dense_reference_on_random_scores():
    """The in-place count against the plain definition (a dense history mask), with ties, repeated history
    items, held-out items in the history, non-candidates and never-trained (-inf) positives."""
    rng = np.random.default_rng(0)
    n, num_items = 50, 40
    scores = torch.from_numpy(rng.integers(0, 6, (n, num_items)).astype(np.float32))  # many ties
    target = torch.from_numpy(rng.integers(0, num_items, n))
    pos = scores.gather(1, target[:, None])[:, 0]
    pos[::7] = -torch.inf
    candidates = torch.from_numpy(rng.random(num_items) > 0.2)
    lengths = rng.integers(0, 12, n)
    offsets, values = np.r_[0, np.cumsum(lengths)], rng.integers(-1, num_items + 3, lengths.sum())
    seen = torch.zeros(n, num_items, dtype=torch.bool)
    for u in range(n):
        for item in values[offsets[u] : offsets[u + 1]]:
            if 0 <= item < num_items:
                seen[u, item] = True
    beats = (scores >= pos[:, None]) & candidates[None]
    beats[torch.arange(n), target] = False
    masked, unmasked = full_ranks(scores.clone(), target, pos, candidates, (offsets, values))
    assert unmasked.tolist() == beats.sum(1).tolist()
    assert masked.tolist() == (beats & ~seen).sum(1).tolist()


@pytest.fixture(scope="module")
def seqs(loo_set) -> SequenceSet:
    ws, name = loo_set
    return SequenceSet(TrainingSet(ws.training(name)), max_len=8, time_buckets=16)


def test_masking_removes_the_users_history_from_the_full_ranking(seqs):
    num_items = seqs.data.vocab["ad_id"]

    def history_first(users, split):  # every history item above the target, the target above the rest
        offsets, values = seqs.history_items(users, split)
        scores = torch.zeros(len(users), num_items)
        scores[
            torch.from_numpy(np.repeat(np.arange(len(users)), np.diff(offsets))), torch.from_numpy(values)
        ] = 2.0
        scores[torch.arange(len(users)), torch.from_numpy(seqs.targets(split)[users])] = 1.0
        return scores

    out = rank_split(history_first, seqs, "test", sequence_negatives(seqs, 20))
    assert out["full_hr@1"] == 1.0  # masked: only the history beat it
    assert out["full_unmasked_hr@1"] == 0.0  # every user had a trained item before the test one
    offsets, values = seqs.history_items(np.arange(3), "valid")
    rows = seqs.valid_rows[:3]
    for u in range(3):  # the valid item's history is the user's events before it, all of them
        cut = seqs.data.examples["cut"].iat[rows[u]]
        start = seqs.data.seq_offsets[seqs.user_rows[u]]
        assert (
            values[offsets[u] : offsets[u + 1]].tolist()
            == seqs.data.seq_values["ad_id"][start : start + cut].tolist()
        )


def test_every_command_and_bench_ranks_the_same_negative_lists(loo_set, seqs):
    ws, name = loo_set
    bench = sequence_negatives(
        seqs, 20, seed=0
    )  # bench/sequential.py's popularity row, gemflow evaluate (next-item)
    cfg = load_config(TrainRunConfig, None, {"training_set": name, "tracking.enabled": False,
                                             "model": "sasrec", "next_item.eval_negatives": 20})  # fmt: skip
    training = NextItemTask(cfg, ws.training(name)).negatives  # every trained model's valid and test ranking
    np.testing.assert_array_equal(training, bench)
    catalog = set(training_catalog(seqs.data).tolist())
    for split in ("test", "valid"):  # gemflow evaluate --leave-one-out and bench/ablations.py
        lists = loo_lists(seqs.data, split, num_negatives=20)
        assert np.array_equal(lists.items[:, 0], seqs.data.examples["ad_id"].to_numpy()[lists.rows])
        by_user = dict(
            zip(
                seqs.data.examples["user_row"].to_numpy()[lists.rows].tolist(),
                lists.items[:, 1:],
                strict=True,
            )
        )
        assert sorted(by_user) == sorted(seqs.user_rows.tolist())
        for u, row in zip(seqs.user_rows.tolist(), bench, strict=True):
            np.testing.assert_array_equal(by_user[u], row)
            assert set(row.tolist()) <= catalog
