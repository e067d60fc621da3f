"""Leave-one-out evaluation: the next-event scorer ranks by the user model's retrieval head, user by user,
independently of the other candidates; it refuses models without that head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gemflow.config import load_config
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.training.evaluate import leave_one_out, loo_lists, score_lists
from models.training.prepare import prepare
from tests.models.fixtures import write_training_set

TINY = {
    "model": "user",
    "training_set": "fx",
    "split_mode": "leave_one_out",
    "user_model.objective": "click",  # its click heads and auxiliary next-event head are what is ranked here
    "user_model.d_model": 16,
    "user_model.num_layers": 1,
    "user_model.num_heads": 2,
    "user_model.max_history": 32,
    "user_model.num_user_tokens": 2,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ws = Workspace(tmp_path_factory.mktemp("evaluate-ws"))
    write_training_set(ws.training("fx"), num_users=30, num_ads=120, num_categories=6, seed=3)
    return prepare(load_config(TrainRunConfig, None, TINY), ws)


def test_next_event_scores_are_the_retrieval_head_of_the_last_history_state(setup):
    lists = loo_lists(setup.data, "test", num_negatives=20)
    scores = score_lists(setup.bundle, setup.data, setup.builder, lists, batch_users=7, scorer="next_event")
    assert scores.shape == (len(lists.rows), 21)

    model = setup.bundle.model.eval()
    u = 3  # by hand for one user, alone in its batch
    batch = setup.builder(lists.rows[u : u + 1])
    with torch.no_grad():
        states, _ = model.history_states(batch.history, batch.profile.user_id)
        query = F.normalize(model.next_proj(states[-1]), dim=-1)
        ads = F.normalize(model.sparse.table("ad_id")[torch.from_numpy(lists.items[u])], dim=-1)
    np.testing.assert_allclose(scores[u], (ads @ query).numpy(), rtol=1e-5, atol=1e-6)

    # a user's scores do not depend on the other candidates (reversing the negatives reverses them)
    flipped = type(lists)(lists.rows, np.concatenate([lists.items[:, :1], lists.items[:, :0:-1]], 1))
    again = score_lists(setup.bundle, setup.data, setup.builder, flipped, scorer="next_event")
    np.testing.assert_allclose(again[:, 1:], scores[:, :0:-1], rtol=1e-5, atol=1e-6)

    metrics = leave_one_out(setup.bundle, setup.data, setup.builder, num_negatives=20, scorer="next_event")
    assert metrics["users"] == len(lists.rows) and 0.0 <= metrics["ndcg@10"] <= metrics["hr@10"] <= 1.0


def test_the_next_event_scorer_needs_a_trained_next_event_head(setup):
    ws = Workspace(setup.data.path.parents[1])
    for override in ({"user_model.pooling": "mean"}, {"user_model.next_event_weight": 0.0}):
        other = prepare(load_config(TrainRunConfig, None, {**TINY, **override}), ws)
        lists = loo_lists(other.data, "test", num_negatives=20)
        with pytest.raises(ValueError, match="needs a user model trained with its next-event loss"):
            score_lists(other.bundle, other.data, other.builder, lists, scorer="next_event")
    with pytest.raises(ValueError, match="scorer must be one of"):
        score_lists(setup.bundle, setup.data, setup.builder, loo_lists(setup.data, "test", 20), scorer="dot")
