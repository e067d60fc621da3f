"""Dense tokenization: torchrec EmbeddingCollection over a KeyedJaggedTensor, one shared space."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.data import BatchBuilder
from models.tokenizer import DenseTokens, SparseArch
from models.user_model import UserModel
from tests.models.fixtures import tiny_dense, tiny_set, tiny_user_config


def test_sparse_arch_shapes_shared_tables_and_oov():
    arch = SparseArch(
        {"hist_ad": "ad_id", "cand_ad": "ad_id", "items": "items"}, {"ad_id": 10, "items": 3}, dim=8
    )
    hist = torch.tensor([1, 2, 3, 4])
    out = arch(
        {
            "hist_ad": (hist, torch.tensor([3, 0, 1])),
            "cand_ad": (torch.tensor([3, 99, -1]), torch.tensor([1, 1, 1])),
        },
        batch_size=3,
    )
    assert out["hist_ad"].shape == (4, 8) and out["cand_ad"].shape == (3, 8)
    # one vocabulary: the same ad id is the same vector wherever it appears
    torch.testing.assert_close(out["hist_ad"][2], out["cand_ad"][0])
    # ids outside the vocabulary (new ads, negatives) share the extra OOV row
    torch.testing.assert_close(out["cand_ad"][1], out["cand_ad"][2])
    torch.testing.assert_close(out["cand_ad"][1], arch.table("ad_id")[10])
    assert (
        "items" not in out
    )  # a table named like a dict method builds fine (prefixed), unused features omitted


def test_sparse_arch_rejects_unknown_feature():
    arch = SparseArch({"hist_ad": "ad_id"}, {"ad_id": 5}, dim=4)
    with pytest.raises(KeyError, match="unknown sparse feature"):
        arch({"cand_ad": (torch.tensor([1]), torch.tensor([1]))}, batch_size=1)
    with pytest.raises(ValueError, match="no vocabulary size"):
        SparseArch({"x": "missing_table"}, {}, dim=4)


def test_dense_tokens_one_token_per_feature():
    tokens = DenseTokens(3, 8)(torch.randn(5, 3))
    assert tokens.shape == (5, 3, 8)


def test_history_is_jagged_and_gradients_reach_embeddings():
    cfg = tiny_user_config(next_event_weight=0.1)
    builder = BatchBuilder(
        tiny_set(), tiny_dense(), history_len=cfg.max_history, time_buckets=cfg.time_buckets, gap_to="last"
    )
    rows = np.arange(12)
    batch = builder(rows)
    cut = tiny_set().examples["cut"].to_numpy()[rows]
    assert batch.history.lengths.tolist() == np.minimum(cut, cfg.max_history).tolist()  # no padding
    assert batch.history.ad_id.shape == (int(np.minimum(cut, cfg.max_history).sum()),)
    model = UserModel(cfg, tiny_set().vocab, len(tiny_dense().columns))
    model.train()
    logits, aux = model(batch)
    assert logits.shape == (12, 2)
    (logits.sum() + aux).backward()
    for field in ("ad_id", "action", "surface", "category_id", "advertiser_id", "gap_bucket", "user_id"):
        grad = model.sparse.table(field).grad
        assert grad is not None and grad.abs().sum() > 0, field
