"""The online ranker: one user side shared by many candidates, ablation flags."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models.architectures.ranker import Ranker
from models.training.batch_builder import BatchBuilder
from tests.models.fixtures import tiny_dense, tiny_ranker_config, tiny_set

K, D_USER = 2, 8


def _setup(rows=np.arange(8), **cfg_kw):
    torch.manual_seed(0)
    cfg = tiny_ranker_config(**cfg_kw)
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(len(tiny_set().examples), K * D_USER)).astype(np.float32)
    present = rng.uniform(size=len(emb)) < 0.7
    builder = BatchBuilder(
        tiny_set(), tiny_dense(), history_len=cfg.recent_events, time_buckets=cfg.time_buckets, gap_to="request",
        user_embeddings=emb, user_present=present, num_user_tokens=K,
    )  # fmt: skip
    model = Ranker(cfg, tiny_set().vocab, len(tiny_dense().columns), D_USER).eval()
    return model, builder(rows)


@pytest.mark.parametrize("pooling", ["target", "mean", "din"])
def test_one_call_over_n_candidates_equals_n_single_calls(pooling):
    model, batch = _setup(pooling=pooling)
    n = batch.candidates.ad_id.numel()
    with torch.no_grad():
        # user 0 of the batch against every candidate of the batch
        side = model.user_side(batch.history, batch.profile, batch.user_tokens, batch.user_token_mask)
        first = dataclasses.replace(side, context=side.context[: int(side.offsets[1])], offsets=side.offsets[:2],
                                    kv=[kv[: int(side.offsets[1])] for kv in side.kv],
                                    profile=side.profile[:1])  # fmt: skip
        together = model.score(first, dataclasses.replace(batch.candidates, offsets=torch.tensor([0, n])))
        singles = []
        for i in range(n):
            one = dataclasses.replace(batch, candidates=batch.candidates.select(torch.tensor([i])))
            sub = model.user_side(one.history, one.profile, one.user_tokens, one.user_token_mask)
            sub = dataclasses.replace(sub, context=sub.context[: int(sub.offsets[1])], offsets=sub.offsets[:2],
                                      kv=[kv[: int(sub.offsets[1])] for kv in sub.kv],
                                      profile=sub.profile[:1])  # fmt: skip
            singles.append(model.score(sub, one.candidates.select(torch.tensor([0]))))
    torch.testing.assert_close(together, torch.cat(singles), rtol=1e-5, atol=1e-6)


def test_user_side_is_computed_once_per_request():
    model, batch = _setup()
    calls = {"events": 0, "kv": 0}
    model.events.register_forward_hook(lambda *_: calls.__setitem__("events", calls["events"] + 1))
    for block in model.blocks:
        block.norm_ctx.register_forward_hook(lambda *_: calls.__setitem__("kv", calls["kv"] + 1))
    with torch.no_grad():
        side = model.user_side(batch.history, batch.profile, batch.user_tokens, batch.user_token_mask)
        for _ in range(3):  # e.g. three pages of candidates for the same users
            model.score(side, batch.candidates)
    assert calls == {"events": 1, "kv": len(model.blocks)}


def test_forward_matches_user_side_then_score():
    model, batch = _setup()
    with torch.no_grad():
        logits, _ = model(batch)
        side = model.user_side(batch.history, batch.profile, batch.user_tokens, batch.user_token_mask)
        torch.testing.assert_close(logits, model.score(side, batch.candidates))
    assert logits.shape == (8, 2)


def test_cached_user_tokens_change_scores_and_online_only_ignores_them():
    model, batch = _setup()
    with torch.no_grad():
        a, _ = model(batch)
        b, _ = model(dataclasses.replace(batch, user_tokens=batch.user_tokens + 1.0))
    present = batch.user_token_mask
    assert not torch.allclose(a[present], b[present])
    torch.testing.assert_close(a[~present], b[~present])  # rows without a cached embedding read none
    online, batch = _setup(use_user_tokens=False)
    assert online.user_proj is None
    with torch.no_grad():
        c, _ = online(batch)
        d, _ = online(dataclasses.replace(batch, user_tokens=batch.user_tokens + 1.0))
    torch.testing.assert_close(c, d)


def test_training_step_reaches_all_parts():
    model, batch = _setup(pooling="din")
    model.train()
    logits, _ = model(batch)
    logits.sum().backward()
    assert model.din.score[0].weight.grad.abs().sum() > 0
    assert model.user_proj.weight.grad.abs().sum() > 0
    assert model.sparse.table("category_id").grad.abs().sum() > 0


def test_default_ranker_costs_at_most_a_fifth_of_a_megaflop_per_candidate():
    """Serving budget: 1,000 candidates in ~25 ms on 2 CPU cores needs a light candidate side."""
    from torch.utils.flop_counter import FlopCounterMode

    from models.config import RankerConfig

    torch.manual_seed(0)
    cfg = RankerConfig(attention_backend="reference")  # the default width, 64 recent events
    data, dense = tiny_set(), tiny_dense()
    builder = BatchBuilder(data, dense, history_len=cfg.recent_events, time_buckets=cfg.time_buckets,
                           gap_to="request")  # fmt: skip
    model = Ranker(cfg, data.vocab, len(dense.columns), cfg.d_model).eval()
    batch = builder(np.arange(1))
    n = 500
    cands = data.candidates(np.resize(np.arange(len(data.examples)), n), builder.dense)
    cands = dataclasses.replace(cands, offsets=torch.tensor([0, n]))
    with torch.no_grad():
        side = model.user_side(batch.history, batch.profile)
        with FlopCounterMode(display=False) as counter:
            logits = model.score(side, cands)
    assert logits.shape == (n, 2)
    per_candidate = counter.get_total_flops() / n
    assert 0 < per_candidate <= 0.2e6, f"{per_candidate:.0f} FLOPs per candidate"
