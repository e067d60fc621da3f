"""The offline user model: candidate-independent user tokens, causal history, long jagged sequences."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models.architectures.user_model import UserModel
from models.training.batch import Events
from models.training.batch_builder import BatchBuilder
from tests.models.fixtures import tiny_dense, tiny_set, tiny_user_config


def _model_and_batch(rows=np.arange(10), **cfg_kw):
    torch.manual_seed(0)
    cfg = tiny_user_config(**cfg_kw)
    builder = BatchBuilder(
        tiny_set(),
        tiny_dense(),
        history_len=cfg.max_history,
        time_buckets=cfg.time_buckets,
        gap_to="previous",
    )
    model = UserModel(cfg, tiny_set().vocab, len(tiny_dense().columns)).eval()
    return model, builder(rows)


def test_user_tokens_do_not_depend_on_candidates():
    model, batch = _model_and_batch()
    captured = []
    model.summary.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
    other = dataclasses.replace(
        batch.candidates,
        ad_id=batch.candidates.ad_id.flip(0),
        category_id=(batch.candidates.category_id + 1) % 4,
        dense=torch.randn_like(batch.candidates.dense),
    )
    with torch.no_grad():
        logits_a, _ = model(batch)
        logits_b, _ = model(dataclasses.replace(batch, candidates=other))
        direct = model.encode_user(batch.history, batch.profile.user_id)
    assert not torch.allclose(logits_a, logits_b)  # the candidates matter to the head...
    torch.testing.assert_close(captured[0], captured[1])  # ...but never to the user tokens
    assert direct.shape == (10, model.num_user_tokens, model.cfg.d_model)


def test_scoring_many_candidates_equals_one_by_one():
    model, batch = _model_and_batch(rows=np.arange(6))
    with torch.no_grad():
        user = model.encode_user(batch.history, batch.profile.user_id)
        # every candidate of the batch against user 0, at once and one at a time
        many = dataclasses.replace(batch.candidates, offsets=torch.tensor([0, 6]))
        together = model.score(user[:1], many)
        alone = torch.cat(
            [model.score(user[:1], batch.candidates.select(torch.tensor([i]))) for i in range(6)]
        )
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_causal_states_ignore_later_events():
    model, batch = _model_and_batch(rows=np.arange(20), causal=True)
    h = batch.history
    user = int(torch.argmax(h.lengths))
    start, end = int(h.offsets[user]), int(h.offsets[user + 1])
    assert end - start >= 4
    changed = h.ad_id.clone()
    changed[end - 1] = (changed[end - 1] + 1) % tiny_set().vocab["ad_id"]  # rewrite the last event
    with torch.no_grad():
        a, _ = model.history_states(h, batch.profile.user_id)
        b, _ = model.history_states(dataclasses.replace(h, ad_id=changed), batch.profile.user_id)
    torch.testing.assert_close(a[start : end - 1], b[start : end - 1])
    assert not torch.allclose(a[end - 1], b[end - 1])


def test_next_event_loss_needs_causal_attention():
    from models.config import TrainRunConfig, validate

    cfg = TrainRunConfig()
    cfg.user_model.causal = False
    with pytest.raises(ValueError, match="causal"):
        validate(cfg)


def test_long_history_and_empty_history():
    """One user with 4,096 events and one with none go through the jagged path together."""
    torch.manual_seed(0)
    cfg = tiny_user_config(max_history=4096, attention_backend="auto")
    vocab = {"ad_id": 50, "advertiser_id": 5, "category_id": 5, "action": 8, "surface": 5, "user_id": 2}
    model = UserModel(cfg, vocab, num_dense=1).eval()
    n = 4096
    events = Events(
        ad_id=torch.randint(0, 50, (n,)), action=torch.randint(0, 8, (n,)), surface=torch.randint(0, 5, (n,)),
        category_id=torch.randint(0, 5, (n,)), advertiser_id=torch.randint(0, 5, (n,)),
        ts=torch.arange(n) * 60, gap_bucket=torch.randint(0, cfg.time_buckets, (n,)), offsets=torch.tensor([0, n, n]),
    )  # fmt: skip
    with torch.no_grad():
        tokens = model.encode_user(events, torch.tensor([0, 1]))
    assert tokens.shape == (2, cfg.num_user_tokens, cfg.d_model)
    assert torch.isfinite(tokens).all()


def test_mean_pooling_ablation():
    model, batch = _model_and_batch(pooling="mean")
    assert len(model.blocks) == 0 and model.num_user_tokens == 1
    logits, _ = model(batch)
    assert logits.shape == (10, 2) and torch.isfinite(logits).all()


def test_a_user_day_scored_at_once_equals_each_impression_alone():
    from models.inference.bundle import predict

    cfg = tiny_user_config(snapshot="day")
    builder = BatchBuilder(
        tiny_set(), tiny_dense(), history_len=cfg.max_history, time_buckets=cfg.time_buckets,
        gap_to="previous", snapshot="day",
    )  # fmt: skip
    torch.manual_seed(0)
    model = UserModel(cfg, tiny_set().vocab, len(tiny_dense().columns)).eval()
    rows = builder.grouped(np.arange(60))
    together = predict(model, builder, rows, batch_size=64)  # user-days share one history each
    alone = predict(model, builder, rows, batch_size=1)  # every impression encodes its own copy
    assert builder(rows).history.batch_size < len(rows)
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-6)


def test_the_attribute_table_is_reused_at_inference_and_recomputed_when_its_weights_change():
    from models.sequential.data import ItemAttributes

    vocab = tiny_set().vocab
    ads = vocab["ad_id"] + 1  # + the out-of-vocabulary row
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 4, ads)
    values = np.concatenate(
        [np.sort(rng.choice(9, c, replace=False)) for c in counts]
    )  # distinct, sorted per ad
    items = ItemAttributes(torch.from_numpy(values), torch.from_numpy(np.concatenate([[0], np.cumsum(counts)])),
                           torch.zeros(ads, dtype=torch.int64), torch.zeros(ads, dtype=torch.int64))  # fmt: skip
    cfg = tiny_user_config(objective="next_item", item_attributes="all", embedding_init="normal")
    model = UserModel(cfg, vocab, len(tiny_dense().columns), items).eval()
    ids = torch.tensor([0, 3, 3, ads - 2])
    with torch.inference_mode():
        first = model.frozen_attribute_table()
        assert model.frozen_attribute_table() is first  # reused, not recomputed
        torch.testing.assert_close(model.attribute_tokens(ids), model.attribute_table()[ids])
    with torch.no_grad():
        model.attributes.weight.mul_(2.0)  # an optimizer step, a load_state_dict: in place
    with torch.inference_mode():
        torch.testing.assert_close(model.attribute_tokens(ids), model.attribute_table()[ids])
        torch.testing.assert_close(model.frozen_attribute_table(), 2.0 * first)
    model.train()  # training reads the table it differentiates
    model.attribute_tokens(ids).sum().backward()
    assert model.attributes.weight.grad is not None and model.attributes.weight.grad.abs().sum() > 0
