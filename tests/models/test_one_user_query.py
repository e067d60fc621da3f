"""The scripted one-user next-item query (``models.inference.one_user_query``) equals the eager batched path
(``query_vectors``) for every history length, with and without item attributes, relative positions past the bias
table, time biases and out-of-vocabulary ids; models it does not cover get None and keep the eager path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from features.schema import ACTIONS, SURFACES
from models.config import UserModelConfig
from models.embeddings.sequences import UserSequences, query_vectors
from models.inference.bundle import ModelBundle, build_model
from models.inference.one_user_query import script_query
from models.sequential.data import ItemAttributes
from models.training.dense import DenseSpec

ADS, CATEGORIES, ADVERTISERS = 40, 5, 7
VOCAB = {"ad_id": ADS, "advertiser_id": ADVERTISERS, "category_id": CATEGORIES, "action": len(ACTIONS),
         "surface": len(SURFACES), "gender": 3, "country": 4, "user_id": 10}  # fmt: skip
SHAPE = {"d_model": 16, "num_layers": 2, "num_heads": 2, "num_user_tokens": 2, "max_history": 64,
         "objective": "next_item", "embedding_init": "normal", "max_rel_pos": 3, "time_buckets": 8}  # fmt: skip


def items(seed: int) -> ItemAttributes:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, ADS + 1)
    values = np.concatenate([np.sort(rng.choice(9, c, replace=False)) for c in counts])
    offsets = np.concatenate([[0], np.cumsum(counts)])
    zeros = torch.zeros(ADS + 1, dtype=torch.int64)
    return ItemAttributes(torch.from_numpy(values), torch.from_numpy(offsets), zeros, zeros)


def bundle(seed: int, **overrides) -> ModelBundle:
    torch.manual_seed(seed)
    cfg = UserModelConfig(**{**SHAPE, **overrides})
    table = items(seed) if cfg.item_attributes == "all" else None
    model = build_model("user", cfg, VOCAB, 0, items=table).eval()
    with torch.no_grad():  # the biases start at zero: spread them so the test reads them
        for block in model.blocks:
            block.attn.pos_bias.normal_(0, 1)
            block.attn.time_bias.normal_(0, 1)
    return ModelBundle("user", model, VOCAB, DenseSpec([], [], []), 0, "v", "", items=table)


def user(n: int, seed: int) -> UserSequences:
    rng = np.random.default_rng(seed)
    ad = rng.integers(0, ADS + 3, n)  # a few ids past the vocabulary: the out-of-vocabulary row
    values = {"ad_id": ad, "action": rng.integers(0, len(ACTIONS), n), "surface": rng.integers(0, len(SURFACES), n),
              "category_id": rng.integers(0, CATEGORIES, n), "advertiser_id": rng.integers(0, ADVERTISERS, n),
              "ts": np.sort(rng.integers(1_700_000_000, 1_700_100_000, n))}  # fmt: skip
    return UserSequences(np.array([3], np.int64), np.array([0, n], np.int64), values)


@pytest.mark.parametrize("attributes", ["none", "all"])
def test_the_scripted_query_equals_the_eager_one(attributes):
    b = bundle(0, item_attributes=attributes)
    scripted = script_query(b.model)
    assert scripted is not None
    for n in (1, 2, 3, 5, 12, 40):  # past max_rel_pos, and the one-event user
        seqs = user(n, seed=n)
        eager = query_vectors(b, seqs)
        fast = query_vectors(b, seqs, one_user=scripted)
        assert fast.shape == eager.shape == (1, SHAPE["d_model"])
        np.testing.assert_allclose(fast, eager, rtol=1e-5, atol=1e-5)
        assert np.abs(eager).max() > 1.0  # a query (cosine / temperature), not zeros


def test_models_it_does_not_cover_keep_the_eager_path():
    assert script_query(bundle(1, pooling="mean").model) is None
    assert script_query(bundle(1, objective="click").model) is None
    b = bundle(2)
    scripted = script_query(b.model)
    empty = UserSequences(np.array([3], np.int64), np.array([0, 0], np.int64), {f: np.zeros(0, np.int64) for f in
                          ("ad_id", "action", "surface", "category_id", "advertiser_id", "ts")})  # fmt: skip
    np.testing.assert_array_equal(query_vectors(b, empty, one_user=scripted), query_vectors(b, empty))
    two = UserSequences.take(user(4, 0), np.array([0, 0]))  # two users: the batched path
    np.testing.assert_array_equal(query_vectors(b, two, one_user=scripted), query_vectors(b, two))
