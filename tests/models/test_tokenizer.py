"""Dense tokenization: torchrec EmbeddingCollection over a KeyedJaggedTensor, one shared space."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.architectures.tokenizer import DenseTokens, SparseArch
from models.architectures.user_model import UserModel
from models.training.batch_builder import BatchBuilder
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
        tiny_set(),
        tiny_dense(),
        history_len=cfg.max_history,
        time_buckets=cfg.time_buckets,
        gap_to="previous",
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


def test_plain_tables_hold_the_same_state_and_rows_as_the_embedding_collection():
    features, sizes = {"hist_ad": "ad_id", "cand_ad": "ad_id", "user": "user_id"}, {"ad_id": 10, "user_id": 4}
    torch.manual_seed(0)
    collection = SparseArch(features, sizes, dim=8)
    plain = SparseArch(features, sizes, dim=8, torchrec=False)
    assert collection.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(collection.state_dict())
    ids = {
        "hist_ad": (torch.tensor([1, 2, 3, 11, -4]), torch.tensor([3, 0, 2])),
        "cand_ad": (torch.tensor([3, 99, 0]), torch.tensor([1, 1, 1])),
        "user": (torch.tensor([0, 3, 7]), torch.tensor([1, 1, 1])),
    }
    want, got = collection(ids, batch_size=3), plain(ids, batch_size=3)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(got[key], want[key])


def test_a_loaded_model_reads_without_torchrec_and_scores_as_trained(tmp_path):
    """``load_bundle`` builds the tables as ``PlainTables``: the same scores as the trained (torchrec) model, the
    training path (KeyedJaggedTensor, gradients on) against the loaded model's."""
    from models.architectures.ranker import Ranker
    from models.inference.bundle import ModelBundle, load_bundle, save_bundle
    from tests.models.fixtures import tiny_ranker_config

    torch.manual_seed(0)
    user_cfg, ranker_cfg = tiny_user_config(), tiny_ranker_config()
    num_dense = len(tiny_dense().columns)
    kinds = {  # kind: (the trained model, the batches it reads)
        "user": (
            UserModel(user_cfg, tiny_set().vocab, num_dense),
            (user_cfg.max_history, user_cfg.time_buckets, "previous"),
        ),
        "ranker": (
            Ranker(ranker_cfg, tiny_set().vocab, num_dense),
            (ranker_cfg.recent_events, ranker_cfg.time_buckets, "request"),
        ),
    }
    for kind, (trained, (history, buckets, gap_to)) in kinds.items():
        batch = BatchBuilder(
            tiny_set(), tiny_dense(), history_len=history, time_buckets=buckets, gap_to=gap_to
        )(np.arange(12))
        trained.eval()
        save_bundle(
            tmp_path / kind / "model.pt",
            ModelBundle(kind, trained, tiny_set().vocab, tiny_dense(), 0, "v", ""),
        )
        loaded = load_bundle(tmp_path / kind).model
        assert type(loaded.sparse.ec).__name__ == "PlainTables"
        want = trained(batch)[0].detach()  # gradients on: the EmbeddingCollection over a KeyedJaggedTensor
        with torch.no_grad():  # inference: rows gathered straight from the tables
            torch.testing.assert_close(loaded(batch)[0], want, rtol=0, atol=1e-6)
        torch.testing.assert_close(loaded(batch)[0].detach(), want, rtol=0, atol=1e-6)  # PlainTables.forward
