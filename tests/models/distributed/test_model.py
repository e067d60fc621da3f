"""The split user model (embeddings outside, dense tower inside the engine) computes what the model computes."""

from __future__ import annotations

import copy

import numpy as np
import torch

from gemflow.workspace import Workspace
from models.training.distributed.model import DenseTower, ShardableSparse, next_event_sources, sparse_ids
from models.training.prepare import prepare
from models.training.train import loss_fn
from tests.models.distributed.conftest import small_config


def _split(model):
    sparse = ShardableSparse(model.sparse, model.cfg.d_model)
    return sparse, DenseTower(model)


def test_split_model_matches_user_model_forward_and_backward(training_set, tmp_path):
    cfg = small_config(training_set)
    setup = prepare(cfg, Workspace(tmp_path / "ws"))
    reference = setup.bundle.model
    reference.train()
    sparse, tower = _split(copy.deepcopy(reference))
    tower.train()
    batch = setup.builder(setup.train_rows[:24])

    torch.manual_seed(7)  # the negatives of the next-event loss are the only random draw
    ref_logits, ref_aux = reference(batch)
    torch.manual_seed(7)
    ids, negatives = sparse_ids(tower.model, batch)
    logits, aux = tower(sparse(ids, batch.history.batch_size), batch, negatives)

    torch.testing.assert_close(logits, ref_logits)
    assert ref_aux.item() > 0
    torch.testing.assert_close(aux, ref_aux)

    loss_fn(ref_logits, batch.labels, ref_aux, cfg).backward()
    loss_fn(logits, batch.labels, aux, cfg).backward()
    for name in ("blocks.0.attn.qkv.weight", "summary_queries", "head.1.weight", "next_proj.weight"):
        ref_grad = reference.get_parameter(name).grad
        torch.testing.assert_close(tower.model.get_parameter(name).grad, ref_grad, msg=name)
    ref_table = reference.sparse.ec.embeddings["t_ad_id"].weight.grad
    torch.testing.assert_close(sparse.ec.embeddings["t_ad_id"].weight.grad, ref_table)


def test_eval_mode_looks_up_no_next_event_rows(training_set, tmp_path):
    setup = prepare(small_config(training_set), Workspace(tmp_path / "ws"))
    _, tower = _split(setup.bundle.model)
    tower.eval()
    ids, negatives = sparse_ids(tower.model, setup.builder(setup.valid_rows[:8]))
    assert negatives is None and "next_negative" not in ids


def test_next_event_sources_skip_each_sequences_last_event_and_empty_sequences(training_set, tmp_path):
    setup = prepare(small_config(training_set), Workspace(tmp_path / "ws"))
    rows = setup.train_rows[:16]
    history = setup.builder(rows).history
    src = next_event_sources(history).numpy()
    lengths = history.lengths.numpy()
    assert len(src) == int(np.maximum(lengths - 1, 0).sum())
    ends = history.offsets[1:].numpy() - 1
    assert not set(src) & set(ends[lengths > 0])
