"""The ranker's inference fast path (direct embedding gathers; one user's candidates through ``models.inference.one_user``,
eager and scripted by TorchScript: one dense attention block, the head expanded over the shared profile) against
the training path on the same weights and inputs (torchrec KeyedJaggedTensor lookups, jagged attention, the plain
head): the same scores, for every config it serves."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
import torch

from models.architectures.ranker import Ranker
from models.attention.shared_context import FusedAttention, TorchAttention
from models.inference import native, one_user
from models.training.batch import EVENT_ID_FIELDS, Candidates, Events, Profile
from tests.models.fixtures import tiny_ranker_config

VOCAB = {"ad_id": 50, "advertiser_id": 6, "category_id": 5, "action": 8, "surface": 5, "gender": 3, "country": 4,
         "user_id": 10}  # fmt: skip
D_USER, K = 8, 2


def _model(**cfg_kw) -> Ranker:
    torch.manual_seed(0)
    model = Ranker(tiny_ranker_config(attention_backend="auto", **cfg_kw), VOCAB, 3, D_USER).eval()
    with torch.no_grad():  # spread the weights so every part of the model moves the scores
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _inputs(n_events: list[int], n_cands: list[int], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    e, b, n = sum(n_events), len(n_events), sum(n_cands)

    def ints(low, high, size):
        return torch.randint(low, high, (size,), generator=g)

    # ad ids past the vocabulary (50) and -1 ids take the OOV row on both paths
    events = Events(ints(-1, 60, e), ints(0, 8, e), ints(0, 5, e), ints(0, 5, e), ints(0, 6, e),
                    torch.arange(e) * 60, ints(0, 32, e), torch.cumsum(torch.tensor([0, *n_events]), 0))  # fmt: skip
    profile = Profile(ints(0, 10, b), ints(-1, 3, b), ints(0, 4, b), torch.randn(b, 1, generator=g))
    cands = Candidates(ints(0, 60, n), ints(-1, 6, n), ints(0, 5, n), ints(0, 5, n), torch.randn(n, 3, generator=g),
                       torch.cumsum(torch.tensor([0, *n_cands]), 0))  # fmt: skip
    tokens = torch.randn(b, K, D_USER, generator=g)
    return events, profile, cands, tokens


def _scores(model: Ranker, inputs, fast: bool, mask=None) -> torch.Tensor:
    events, profile, cands, tokens = inputs
    mask = torch.ones(len(profile.gender), dtype=torch.bool) if mask is None else mask
    with torch.set_grad_enabled(not fast):  # gradients on = the training path
        side = model.user_side(events, profile, tokens, mask)
        return model.score(side, cands).detach()


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"use_user_tokens": False},
        {"interaction_layers": 1},
        {"pooling": "mean"},
        {"pooling": "din"},
        {"num_layers": 1, "ffn_mult": 4},
    ],  # fmt: skip
    ids=["default", "online_only", "interaction", "mean", "din", "one_layer_ffn4"],
)
@pytest.mark.parametrize(("events", "cands"), [([12], [30]), ([12], [300]), ([0], [7]), ([5, 9], [4, 11])])
@pytest.mark.parametrize("torchscript", [False, True], ids=["eager", "torchscript"])
def test_fast_path_equals_training_path(cfg, events, cands, torchscript):
    model = _model(**cfg)
    if torchscript:  # the serving path (models.inference.one_user) applies to target-aware pooling without interaction layers
        applies = cfg.get("pooling", "target") == "target" and not cfg.get("interaction_layers")
        assert model.script_one_user() == applies
        assert isinstance(model.one_user_scorer(), torch.jit.ScriptModule) == applies
    inputs = _inputs(events, cands)
    fast, slow = _scores(model, inputs, fast=True), _scores(model, inputs, fast=False)
    assert fast.shape == (sum(cands), 2)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    assert fast[:, 0].std() > 1e-3  # the candidates really are scored differently


@pytest.mark.parametrize("torchscript", [False, True], ids=["eager", "torchscript"])
def test_fast_path_with_an_empty_context(torchscript):
    """No recent events and no cached tokens: attention reads nothing, as in the jagged ops."""
    model = _model()
    assert not torchscript or model.script_one_user()
    inputs = _inputs([0], [9])
    no_tokens = torch.zeros(1, dtype=torch.bool)
    fast = _scores(model, inputs, fast=True, mask=no_tokens)
    torch.testing.assert_close(fast, _scores(model, inputs, fast=False, mask=no_tokens), rtol=0, atol=1e-5)


def test_training_mode_keeps_the_plain_head():
    """Dropout must still apply while training, so the expanded head is used only in eval mode."""
    model = _model(dropout=0.5).train()
    inputs = _inputs([6], [40])
    torch.manual_seed(0)
    a = _scores(model, inputs, fast=True)
    torch.manual_seed(1)
    b = _scores(model, inputs, fast=True)
    assert not torch.allclose(a, b)  # dropout is live
    model.eval()
    torch.testing.assert_close(
        _scores(model, inputs, fast=True), _scores(model, inputs, fast=False), rtol=0, atol=1e-5
    )


def test_one_request_in_batches_equals_one_call():
    """Serving scores a request in batches that share one user side; batching changes nothing."""
    model = _model()
    events, profile, cands, tokens = _inputs([10], [25])
    with torch.no_grad():
        side = model.user_side(events, profile, tokens, torch.ones(1, dtype=torch.bool))
        whole = model.score(side, cands)
        parts = [
            model.score(
                side,
                dataclasses.replace(cands.select(torch.arange(lo, hi)), offsets=torch.tensor([0, hi - lo])),
            )
            for lo, hi in ((0, 10), (10, 25))
        ]
    # equal up to fp32 rounding: on AVX-512 (AMD EPYC, family 25 model 17) the GEMMs of 10, 15 and 25 rows take
    # kernels that sum in different orders (measured 1.01e-6 absolute, 2.1e-6 relative on scores of ~0.5)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)


def test_the_one_user_path_adds_nothing_to_the_state_dict():
    """``models.inference.one_user`` runs the ranker's own layers: no parameters of its own, none saved twice."""
    model = _model()
    keys = list(model.state_dict())
    assert model.one_user_scorer() is not None
    assert model.script_one_user()
    assert list(model.state_dict()) == keys
    with torch.no_grad():  # it follows the ranker's weights
        before = _scores(model, _inputs([6], [80]), fast=True)
        model.head[4].bias.add_(1.0)
        after = _scores(model, _inputs([6], [80]), fast=True)
    torch.testing.assert_close(after[:, 0], before[:, 0] + 1.0, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tokens", [True, False], ids=["tokens", "no_tokens"])
@pytest.mark.parametrize("n_events", [12, 0])
@pytest.mark.parametrize("variant", ["eager", "torchscript", "one_op"])
def test_one_user_side_equals_the_training_user_side(variant, n_events, tokens):
    """One user's context, K/V and profile in one call (``OneUserScorer.user_side``; ``one_op``: gemflow's C++ op
    ``one_user_side``, scripted) against the training path's ``user_side`` (torchrec lookups, jagged concat), OOV
    ids included; and it follows the embedding tables."""
    model = _model()
    if variant == "torchscript":
        assert model.script_one_user(one_user.PYTORCH)
    elif variant == "one_op":
        assert native.load() and one_user.FusedOneUserScorer.applies(model)
        model.__dict__["_one_user"] = torch.jit.script(one_user.FusedOneUserScorer(model).eval())
    events, profile, _, user_tokens = _inputs([n_events], [1])
    mask = torch.tensor([tokens])
    for _ in range(2):
        with torch.inference_mode():
            fast = model.user_side(events, profile, user_tokens, mask)
        with torch.enable_grad():
            slow = model.user_side(events, profile, user_tokens, mask)
        assert fast.context.shape[0] == n_events + (K if tokens else 0)
        for a, b in [
            (fast.context, slow.context),
            (fast.profile, slow.profile),
            *zip(fast.kv, slow.kv, strict=True),
        ]:
            # (the op's LayerNorms sum in another order than PyTorch's: equal within float32 rounding, 1e-6 relative)
            torch.testing.assert_close(a, b.detach(), rtol=1e-6 if variant == "one_op" else 0, atol=1e-6)
        assert fast.offsets.tolist() == slow.offsets.tolist()
        with torch.no_grad():  # the same tables, not copies: a change to the weights shows on the next call
            model.sparse.table("ad_id").mul_(2.0)
            model.sparse.table("gender").add_(1.0)


@pytest.mark.parametrize(
    "attention", [FusedAttention, TorchAttention], ids=["fused_attention", "torch_attention"]
)
@pytest.mark.parametrize("use_onednn", [True, False], ids=["onednn", "pytorch_gemms"])
def test_both_gemm_kernels_of_the_scripted_path_equal_the_training_path(use_onednn, attention):
    """``one_user.script`` keeps whichever GEMM kernel is faster on the CPU, and the attention is gemflow's fused op
    where it is built: each combination must give the training path's scores (300 candidates: enough rows for the
    oneDNN path to apply)."""
    assert native.load()
    model = _model()
    scorer = one_user.OneUserScorer(model, use_onednn, attention())
    model.__dict__["_one_user"] = torch.jit.script(scorer.eval())
    inputs = _inputs([12], [300])
    torch.testing.assert_close(
        _scores(model, inputs, fast=True), _scores(model, inputs, fast=False), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("n_cands", [0, 1, 7, 300])
@pytest.mark.parametrize("n_events", [12, 0])
@pytest.mark.parametrize("cached_query", [True, False], ids=["first_query", "no_first_query"])
def test_the_one_op_scorer_equals_the_training_path(cached_query, n_events, n_cands):
    """``FusedOneUserScorer`` (gemflow's C++ op ``one_user_score``), scripted as serving runs it, against the
    training path's scores: with block 0's cached queries or without them, an empty context (user tokens only) and
    0-300 candidates."""
    assert native.load()
    model = _model()
    assert one_user.FusedOneUserScorer.applies(model)
    scorer = torch.jit.script(one_user.FusedOneUserScorer(model).eval())
    events, profile, cands, tokens = inputs = _inputs([n_events], [n_cands])
    with torch.inference_mode():
        side = model.user_side(events, profile, tokens, torch.ones(1, dtype=torch.bool))
        queries = model.candidate_queries(cands, project=True)
        first = queries.first_query if cached_query else None
        logits = scorer(queries.token, first, side.kv, side.profile.reshape(-1))
    assert logits.shape == (n_cands, 2)
    torch.testing.assert_close(logits, _scores(model, inputs, fast=False), rtol=0, atol=1e-5)


def test_the_one_op_scorer_refuses_what_it_cannot_score():
    assert native.load()
    model = _model()
    scorer = one_user.FusedOneUserScorer(model)
    events, profile, cands, tokens = _inputs([12], [5])
    with torch.inference_mode():
        side = model.user_side(events, profile, tokens, torch.ones(1, dtype=torch.bool))
        queries = model.candidate_queries(cands, project=True)
        with pytest.raises(RuntimeError, match="expected .* weights for 1 blocks"):
            scorer(queries.token, None, side.kv[:1], side.profile.reshape(-1))
        with pytest.raises(RuntimeError, match="token must be a .* float32"):
            scorer(queries.token.double(), None, side.kv, side.profile.reshape(-1))
        with pytest.raises(RuntimeError, match="the head's first linear takes"):
            scorer(queries.token, None, side.kv, side.profile.reshape(-1)[:-1])
        ids = [getattr(events, f) for f in EVENT_ID_FIELDS] + [events.gap_bucket]
        side_args = [ids, scorer.side_tables, scorer.event_sizes, *scorer.side_norm, scorer.side_norm_eps, None, None,
                     None, scorer.kv_weights, scorer.kv_eps, scorer.heads]  # fmt: skip
        context, kv = torch.ops.gemflow.one_user_side(*side_args)
        assert context.shape == (12, model.cfg.d_model) and len(kv) == len(model.blocks)
        with pytest.raises(RuntimeError, match="expected 8 K/V weights for 2 blocks, got 7"):
            torch.ops.gemflow.one_user_side(*side_args[:9], scorer.kv_weights[:-1], *side_args[10:])
        with pytest.raises(RuntimeError, match="id fields, .* tables"):
            torch.ops.gemflow.one_user_side(ids[:-1], *side_args[1:])
        with pytest.raises(RuntimeError, match="must be int64 with one id per event"):
            torch.ops.gemflow.one_user_side([i.int() for i in ids], *side_args[1:])
    unbiased = _model()
    unbiased.head[1].bias = None
    assert not one_user.FusedOneUserScorer.applies(unbiased)


def test_script_keeps_the_fastest_variant_and_says_which(caplog):
    model = _model()
    with caplog.at_level(logging.INFO, logger="models.inference.one_user"):
        scripted = one_user.script(model, rows=200)
    assert scripted is not None
    assert isinstance(scripted.blocks[0].attention, FusedAttention)  # built on this machine: used
    (message,) = [r.getMessage() for r in caplog.records]
    assert "(attention: gemflow's fused op)" in message
    timed = dict(
        part.rsplit(" ", 2)[:2] for part in message.split(" candidates: ", 1)[1].split("; ")[0].split(", ")
    )
    assert set(timed) >= {"PyTorch's GEMMs", "gemflow's one-op scorer"}
    chosen = message.rsplit("using ", 1)[1]
    assert chosen in timed and float(timed[chosen]) == min(float(t) for t in timed.values())
    assert one_user.variant_of(scripted) == chosen
    for variant in timed:  # a named variant is compiled alone (a server's worker processes take its choice)
        assert one_user.variant_of(one_user.script(model, variant=variant)) == variant
    with pytest.raises(ValueError, match="not available here"):
        one_user.script(model, variant="no such variant")


def test_timing_picks_the_faster_variant():
    calls = {"slow": 0, "fast": 0}

    def slow(*_):
        calls["slow"] += 1
        time.sleep(0.005)

    def fast(*_):
        calls["fast"] += 1

    ms = one_user._time_variants({"slow": slow, "fast": fast}, (), warm=2, rounds=3)
    assert min(ms, key=ms.get) == "fast" and ms["slow"] >= 5.0
    assert calls == {"slow": 5, "fast": 5}  # warm-up calls, then alternating timed rounds


@pytest.mark.parametrize("torchscript", [False, True], ids=["eager", "torchscript"])
def test_candidate_rows_are_padded_to_a_few_sizes_without_changing_a_score(torchscript):
    """``one_user.score_padded``: the scorer sees ``bucket_rows(N)`` rows (zeros past N); every candidate's score is
    the one it gets unpadded."""
    model = _model()
    assert not torchscript or model.script_one_user()
    scorer = model.one_user_scorer()
    seen = []
    for n in (255, 257, 300, 1000):
        events, profile, cands, tokens = _inputs([12], [n])
        with torch.no_grad():
            side = model.user_side(events, profile, tokens, torch.ones(1, dtype=torch.bool))
            queries = model.candidate_queries(cands, project=True)
            args = (side.kv, side.profile.reshape(-1))
            plain = scorer(queries.token, queries.first_query, *args)

            def watched(token, *rest):
                seen.append(token.shape[0])
                return scorer(token, *rest)

            padded = one_user.score_padded(watched, queries.token, queries.first_query, *args)
            torch.testing.assert_close(padded, plain, rtol=0, atol=1e-5)
            torch.testing.assert_close(model.score(side, cands), plain, rtol=0, atol=1e-5)
    assert seen == [255, 264, 304, 1008]
