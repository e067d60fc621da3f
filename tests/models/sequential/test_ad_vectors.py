"""Retrieval vectors are the next-item score's own: query . ad vector == the model's score of that ad, by raw id;
the file keeps them and their version; a model without a next-item head is refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gemflow.config import load_config
from models.config import TrainRunConfig
from models.embeddings.ad_vectors import (
    USER_QUERY_FILE,
    AdVectors,
    UserQueries,
    ad_vectors,
    read_ad_vectors,
    user_queries,
    write_ad_vectors,
)
from models.inference.bundle import load_bundle
from models.sequential.data import SequenceSet
from models.sequential.evaluate import model_scorer
from models.training.data import TrainingSet
from models.training.train import train
from serving.retrieval.index import IndexConfig, build_index

SMALL = {
    "tracking.enabled": False, "resume": False, "optim.epochs": 1, "optim.batch_size": 32,
    "user_model.d_model": 16, "user_model.max_history": 16, "next_item.eval_negatives": 20,
}  # fmt: skip


@pytest.fixture(scope="module")
def trained(loo_set, tmp_path_factory):
    ws, name = loo_set
    cfg = load_config(
        TrainRunConfig,
        None,
        {**SMALL, "training_set": name, "output_dir": str(tmp_path_factory.mktemp("run"))},
    )
    run_dir = train(cfg, ws).run_dir
    return ws, name, load_bundle(run_dir), run_dir


def test_query_times_ad_vector_is_the_next_item_score(trained):
    ws, name, bundle, _ = trained
    vecs = ad_vectors(bundle, "gem-user-model/1")
    data = TrainingSet(ws.training(name))
    seqs = SequenceSet(data, bundle.cfg.max_history, bundle.cfg.time_buckets)
    users = np.arange(min(8, seqs.num_users))
    history, user_id = seqs.eval_history(users, "test")
    queries = user_queries(bundle, history, user_id)
    with torch.no_grad():
        expected = model_scorer(bundle.model, seqs)(users, "test").numpy()  # (users, model rows)
    rows = bundle.vocabularies["ad_id"].map(vecs.ad_ids) if "ad_id" in bundle.vocabularies else vecs.ad_ids
    np.testing.assert_allclose(queries @ vecs.vectors.T, expected[:, rows], rtol=1e-4, atol=1e-4)
    # and the index returns the model's own top items for that user
    index = build_index(vecs, IndexConfig(kind="exact"))
    top = index.search(queries[0], "gem-user-model/1", 10)
    np.testing.assert_allclose(top.scores, np.sort(expected[0, rows])[::-1][:10], rtol=1e-4, atol=1e-4)


def test_the_file_keeps_vectors_and_version(trained, tmp_path):
    _, _, bundle, _ = trained
    vecs = ad_vectors(bundle, "gem-user-model/1")
    path = write_ad_vectors(tmp_path / "day", vecs)
    back = read_ad_vectors(path)
    assert back.model_version == "gem-user-model/1"
    np.testing.assert_array_equal(back.ad_ids, vecs.ad_ids)
    np.testing.assert_array_equal(back.vectors, vecs.vectors)


def test_vectors_without_a_version_or_next_item_head_are_refused(trained):
    _, _, bundle, _ = trained
    with pytest.raises(ValueError, match="need the user-model version"):
        AdVectors(np.arange(3), np.zeros((3, 4), np.float32), "")
    click = type(bundle)(**{**bundle.__dict__, "kind": "ranker"})
    with pytest.raises(ValueError, match="objective=next_item"):
        ad_vectors(click, "gem-ranker/1")
    with pytest.raises(ValueError, match="objective=next_item"):
        user_queries(click, None, torch.zeros(1, dtype=torch.long))


def test_the_refresh_writes_the_champions_ad_vectors_with_its_version(trained):
    from models.embeddings.refresh import RefreshConfig, refresh_embeddings

    ws, _, bundle, run_dir = trained
    summary = refresh_embeddings(ws, RefreshConfig(model_uri=str(run_dir), push_online=False, active_days=0))
    written = read_ad_vectors(Path(summary["ad_vectors_path"]))
    assert written.model_version == summary["model_version"]  # the user embeddings' version, the same run
    expected = ad_vectors(bundle, summary["model_version"])
    np.testing.assert_array_equal(written.ad_ids, expected.ad_ids)
    np.testing.assert_allclose(written.vectors, expected.vectors, rtol=1e-6)
    queries = read_ad_vectors(Path(summary["ad_vectors_path"]).parent, USER_QUERY_FILE)
    assert isinstance(queries, UserQueries) and queries.model_version == summary["model_version"]
    assert len(queries.ad_ids) == summary["users"] and (np.diff(queries.ad_ids) > 0).all()
    norms = np.linalg.norm(queries.vectors, axis=1)  # cosine / temperature: every refreshed user has history
    np.testing.assert_allclose(norms, 1 / bundle.cfg.next_item_temperature, rtol=1e-4)
    assert queries.lookup(int(queries.ad_ids[3])) is not None and queries.lookup(-5) is None
