"""The one next-item sampled softmax: its formula by hand, and the user model's next-event loss reads the
configured temperature."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.architectures.sampled_softmax import sampled_softmax_loss
from models.architectures.user_model import UserModel
from models.training.batch_builder import BatchBuilder
from tests.models.fixtures import tiny_dense, tiny_set, tiny_user_config


def test_formula_by_hand_with_temperature_and_a_masked_collision():
    query = torch.tensor([[1.0, 0.0]])
    target = torch.tensor([[1.0, 0.0]])
    negatives = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # the second is the target itself (id 3): masked
    loss = sampled_softmax_loss(query, target, negatives, torch.tensor([3]), torch.tensor([5, 3]), 0.5)
    # logits [1, 0] / 0.5 -> -log(e^2 / (e^2 + 1))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-2.0)), rel=1e-6)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sampled_softmax_loss(query, target, negatives, torch.tensor([3]), torch.tensor([5, 3]), 0.0)


def test_per_row_negatives_equal_the_shared_formula_row_by_row():
    torch.manual_seed(0)
    query, target = torch.randn(3, 4), torch.randn(3, 4)
    negatives, neg_ids = (
        torch.randn(3, 5, 4),
        torch.tensor([[1, 2, 3, 4, 5], [7, 7, 8, 9, 6], [0, 1, 2, 3, 4]]),
    )
    target_ids = torch.tensor([9, 7, 11])  # row 1 drew its own target twice: both masked
    per_row = sampled_softmax_loss(query, target, negatives, target_ids, neg_ids, 0.7)
    rows = [
        sampled_softmax_loss(
            query[i : i + 1], target[i : i + 1], negatives[i], target_ids[i : i + 1], neg_ids[i], 0.7
        )
        for i in range(3)
    ]
    assert per_row.item() == pytest.approx(torch.stack(rows).mean().item(), rel=1e-6)
    logits = torch.cat([(query[1] * target[1]).sum()[None], negatives[1, 2:] @ query[1]]) / 0.7
    assert rows[1].item() == pytest.approx(-torch.log_softmax(logits, 0)[0].item(), rel=1e-6)


def test_user_model_next_event_loss_uses_the_configured_temperature():
    builder = BatchBuilder(tiny_set(), tiny_dense(), history_len=8, time_buckets=16, gap_to="previous")
    batch = builder(np.arange(10))
    losses = []
    for temperature in (0.05, 0.5):
        torch.manual_seed(0)
        model = UserModel(
            tiny_user_config(next_item_temperature=temperature), tiny_set().vocab, len(tiny_dense().columns)
        ).eval()
        states, _ = model.history_states(batch.history, batch.profile.user_id)
        torch.manual_seed(1)  # the same sampled negatives for both
        losses.append(model.next_event_loss(states, batch.history).item())
    # one model, two temperatures: the same cosines scaled differently give different losses
    assert losses[0] != pytest.approx(losses[1], rel=1e-3)
