"""Next-item models: causal states, item vectors, the cumulative-mean kernel against its reference, SASRec's
batch-width invariance, and the losses against hand-computed references."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.architectures.layers import segment_cumulative_mean
from models.architectures.user_model import UserModel
from models.config import NextItemConfig, SASRecConfig, UserModelConfig, resolve_user_model
from models.sequential.data import ItemAttributes, SequenceSet, TrainPairs
from models.sequential.objective import next_item_loss, resolve_loss, resolve_loss_dtype
from models.sequential.sasrec import SASRec
from models.training.data import TrainingSet


@pytest.fixture(scope="module")
def seqs(loo_set) -> SequenceSet:
    ws, name = loo_set
    return SequenceSet(TrainingSet(ws.training(name)), max_len=8, time_buckets=16)


def _user_model(seqs: SequenceSet, **kw) -> UserModel:
    cfg = resolve_user_model(
        UserModelConfig(d_model=16, num_heads=2, max_history=8, time_buckets=16, **kw), True
    )
    items = ItemAttributes.read(seqs.data.path, seqs.data.vocab["ad_id"])
    torch.manual_seed(0)
    return UserModel(cfg, seqs.data.vocab, 1, items).eval()


def _models(seqs: SequenceSet) -> dict:
    torch.manual_seed(0)
    return {
        "gemflow": _user_model(seqs),
        "mean": _user_model(seqs, pooling="mean"),
        "ids_only": _user_model(seqs, item_attributes="none"),
        "sasrec": SASRec(SASRecConfig(d_model=16, num_heads=2, max_len=8), seqs.data.vocab).eval(),
    }


def test_cumulative_mean_matches_a_per_sequence_loop():
    torch.manual_seed(0)
    lengths = torch.tensor([3, 0, 1, 5])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    values = torch.randn(int(lengths.sum()), 4, dtype=torch.float64)
    expected = torch.cat(
        [
            values[a:b].cumsum(0) / torch.arange(1, b - a + 1)[:, None]
            for a, b in zip(offsets[:-1], offsets[1:], strict=True)
        ]
    )
    assert torch.allclose(segment_cumulative_mean(values, offsets), expected)


@pytest.mark.parametrize("name", ["gemflow", "mean", "ids_only", "sasrec"])
def test_states_are_causal_and_item_vectors_consistent(seqs, name):
    model = _models(seqs)[name]
    history, user_id = seqs.eval_history(np.arange(6), "test")
    with torch.no_grad():
        before = model.sequence_states(history, user_id)
        changed = history.ad_id.clone()
        last = history.offsets[1:] - 1
        changed[last] = (changed[last] + 1) % model.num_items  # every sequence's last event
        history.ad_id = changed
        after = model.sequence_states(history, user_id)
        earlier = torch.ones(len(before), dtype=torch.bool)
        earlier[last] = False
        assert torch.allclose(before[earlier], after[earlier], atol=1e-5)  # no event sees a later one
        assert not torch.allclose(before[~earlier], after[~earlier])
        ids = torch.tensor([0, 3, 7, 3])
        assert torch.allclose(model.item_vectors(ids), model.item_vectors()[ids], atol=1e-6)


@pytest.mark.parametrize("name", ["gemflow", "mean", "ids_only"])
def test_states_do_not_see_later_times(seqs, name):
    """Shift the times of every event after position t (keeping the order) in the training set itself, rebuild
    the training batch through the real transform, and the states up to t are unchanged: no time feature
    (the event tokens' gaps, the attention's time biases) reads a time after its own position."""
    model = _models(seqs)[name]
    users = np.arange(6)
    t = 2  # positions 0..t of each window keep their times; later ones move 1..5 days later
    before_batch = seqs.train_batch(users)
    data = seqs.data
    original = data.seq_values["ts"].copy()
    try:
        starts = data.seq_offsets[seqs.user_rows[users]] + np.maximum(0, seqs.train_cut[users] - seqs.max_len)
        shifted = data.seq_values["ts"].copy()
        for i, start in enumerate(starts):
            end = data.seq_offsets[seqs.user_rows[users[i]] + 1]
            shifted[start + t + 1 : end] += 86_400 * (i + 1)
        data.seq_values["ts"] = shifted
        after_batch = seqs.train_batch(users)
    finally:
        data.seq_values["ts"] = original
    assert not torch.equal(before_batch.history.ts, after_batch.history.ts)  # the times did move
    with torch.no_grad():
        before = model.sequence_states(before_batch.history, before_batch.user_id)
        after = model.sequence_states(after_batch.history, after_batch.user_id)
    offsets = before_batch.history.offsets
    position = torch.arange(len(before)) - torch.repeat_interleave(offsets[:-1], offsets.diff())
    early = position <= t
    assert early.any() and (~early).any()
    assert torch.allclose(before[early], after[early], atol=1e-6)
    if name != "mean":  # the time token moves the later states (mean pooling reads tokens only: it moves too)
        assert not torch.allclose(before[~early], after[~early])


def test_item_side_reads_every_attribute(seqs):
    model = _models(seqs)["gemflow"]
    items = ItemAttributes.read(seqs.data.path, seqs.data.vocab["ad_id"])
    ad = int(torch.nonzero(items.offsets[1:] - items.offsets[:-1])[0])
    attrs = items.values[items.offsets[ad] : items.offsets[ad + 1]]
    expected = model.attributes.weight[attrs].mean(0)
    assert torch.allclose(model.attribute_tokens(torch.tensor([ad]))[0], expected, atol=1e-6)


def test_sasrec_reads_an_item_outside_the_vocabulary_as_its_padding_row(seqs):
    # a test history holds the valid item, which may be an id never trained (-1)
    model = _models(seqs)["sasrec"]
    history, user_id = seqs.eval_history(np.arange(3), "test")
    oov = dataclasses.replace(history, ad_id=history.ad_id.clone())
    oov.ad_id[0] = -1
    padding = dataclasses.replace(history, ad_id=history.ad_id.clone())
    padding.ad_id[0] = model.pad_id
    with torch.no_grad():
        assert torch.equal(model.sequence_states(oov, user_id), model.sequence_states(padding, user_id))


def test_sasrec_states_do_not_depend_on_the_batch_width(seqs):
    model = _models(seqs)["sasrec"]
    short = np.flatnonzero(np.minimum(seqs.train_cut, 8) < 4)[:5]
    long = np.flatnonzero(seqs.train_cut >= 8)[:1]
    with torch.no_grad():
        alone = model.sequence_states(*seqs.eval_history(short, "valid"))
        history, user_id = seqs.eval_history(np.r_[short, long], "valid")  # now padded to 8 columns
        together = model.sequence_states(history, user_id)[: len(alone)]
    assert torch.allclose(alone, together, atol=1e-5)


def test_losses_match_their_definitions(seqs):
    model = _models(seqs)["gemflow"]
    batch: TrainPairs = seqs.train_batch(np.arange(16))
    torch.manual_seed(1)
    full = next_item_loss(model, batch, "full", 0)
    query = model.query(model.sequence_states(batch.history, batch.user_id)[batch.sources])
    expected = F.cross_entropy(query @ model.item_vectors().T, batch.targets)
    assert torch.allclose(full, expected, atol=1e-5)
    for kind in ("sampled", "bce"):
        loss = next_item_loss(model, batch, kind, 32)
        assert torch.isfinite(loss) and loss > 0
        loss.backward()
    assert resolve_loss(NextItemConfig(), 10) == "full"
    assert resolve_loss(NextItemConfig(full_softmax_max_items=5), 10) == "sampled"


def test_loss_precision_runs_the_full_softmax_gemms_in_bf16(seqs):
    model = _models(seqs)["gemflow"]
    batch: TrainPairs = seqs.train_batch(np.arange(16))
    assert resolve_loss_dtype(NextItemConfig()) == torch.float32
    bf16 = resolve_loss_dtype(NextItemConfig(loss_precision="bf16"))
    assert bf16 == torch.bfloat16
    assert resolve_loss_dtype(NextItemConfig(loss_precision="auto")) in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="loss_precision must be fp32, bf16 or auto, got 'fp16'"):
        resolve_loss_dtype(NextItemConfig(loss_precision="fp16"))
    fp32_loss = next_item_loss(model, batch, "full", 0)
    assert abs(float(next_item_loss(model, batch, "full", 0, gemm_dtype=bf16)) - float(fp32_loss)) < 1e-3


def test_item_id_dropout_leaves_the_attribute_side_in_training_only(seqs):
    """``item_id_dropout`` 1.0: in training every item vector is its category + brand + attribute tokens alone;
    in evaluation the own id row is always back."""
    model = _user_model(seqs, item_id_dropout=1.0)
    ids = torch.tensor([1, 4, 7])
    with torch.no_grad():
        full = model.item_vectors(ids)
        model.sparse.table("ad_id")[ids] += 1.0  # a different id row: no effect where the row is dropped
        model.train()
        dropped = model.item_vectors(ids)
        assert torch.allclose(dropped, model.item_vectors()[ids], atol=1e-6)
        model.sparse.table("ad_id")[ids] -= 1.0
        assert torch.allclose(model.item_vectors(ids), dropped, atol=1e-6)
        model.eval()
        assert torch.allclose(model.item_vectors(ids), full, atol=1e-6)
        assert not torch.allclose(dropped, full, atol=1e-3)
