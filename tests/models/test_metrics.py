"""NE, AUC, calibration and leave-one-out ranking metrics."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import torch
from torchrec.metrics.ne import NEMetric
from torchrec.metrics.rec_metric import RecTaskInfo

from models.training.data import leave_one_out_split
from models.training.metrics import auc, calibration, normalized_entropy, rank_metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ne_equals_torchrec(seed):
    rng = np.random.default_rng(seed)
    n = 500
    preds = rng.uniform(0.001, 0.999, n)
    labels = (rng.uniform(size=n) < 0.2).astype(np.float64)
    weights = rng.uniform(0.5, 2.0, n)
    task = RecTaskInfo(name="click", label_name="label", prediction_name="pred", weight_name="weight")
    metric = NEMetric(world_size=1, my_rank=0, batch_size=n, tasks=[task], window_size=10 * n)
    metric.update(
        predictions={"click": torch.tensor(preds)},
        labels={"click": torch.tensor(labels)},
        weights={"click": torch.tensor(weights)},
    )
    expected = metric.compute()["ne-click|lifetime_ne"].item()
    assert normalized_entropy(labels, preds, weights) == pytest.approx(expected, rel=1e-9)


def test_ne_of_background_rate_is_one_and_perfect_is_zero():
    labels = np.array([0, 0, 1, 0])
    assert normalized_entropy(labels, np.full(4, 0.25)) == pytest.approx(1.0)
    assert normalized_entropy(labels, labels.astype(float)) < 1e-9


def test_auc_matches_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    preds = rng.integers(0, 5, 60) / 4  # many ties
    labels = rng.integers(0, 2, 60)
    pos, neg = preds[labels == 1], preds[labels == 0]
    pairs = [(p > q) + 0.5 * (p == q) for p, q in itertools.product(pos, neg)]
    assert auc(labels, preds) == pytest.approx(np.mean(pairs))
    assert np.isnan(auc(np.ones(3), np.array([0.1, 0.2, 0.3])))


def test_calibration_and_input_errors():
    assert calibration([1, 0, 0, 0], [0.5, 0.5, 0.5, 0.5]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="probabilities"):
        normalized_entropy([1, 0], [2.3, -1.0])
    with pytest.raises(ValueError, match="differ in length"):
        auc([1, 0, 1], [0.2, 0.3])


def test_rank_metrics_by_hand():
    pos = np.array([0.9, 0.5, 0.1])
    neg = np.array([[0.1, 0.2, 0.3], [0.6, 0.7, 0.1], [0.5, 0.5, 0.5]])
    # ranks: 0, 2, 3 (ties count against the model)
    out = rank_metrics(pos, neg, ks=(1, 3))
    assert out["hr@1"] == pytest.approx(1 / 3)
    assert out["hr@3"] == pytest.approx(2 / 3)
    assert out["ndcg@3"] == pytest.approx((1 + 1 / np.log2(4)) / 3)
    assert out["mrr"] == pytest.approx((1 + 1 / 3 + 1 / 4) / 3)


def test_leave_one_out_split():
    ex = pd.DataFrame(
        {
            "user_id": [1, 1, 1, 1, 1, 1, 2, 2],
            "ts": [1, 2, 3, 4, 5, 6, 1, 2],
            "cut": [0, 1, 2, 3, 4, 5, 0, 1],
            "click": [1, 0, 1, 1, 0, 1, 1, 1],  # user 2 has < 3 positives: unused
        }
    )
    # the negative between the valid (ts 4) and the test positive (ts 6) gives valid a negative to score
    split = leave_one_out_split(ex).tolist()
    assert split == ["train", "train", "train", "valid", "valid", "test", "", ""]
