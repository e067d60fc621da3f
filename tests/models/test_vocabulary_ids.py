"""Training on string / 1e11-sized ids (issue 34): the vocabulary built with the set sizes the tables, the
bundle carries it, and the refresh maps raw ids exactly as training did."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from features.training_sets import build_vocabularies
from features.vocabulary import OOV, VocabularyConfig, save_vocabularies, text_id
from gemflow.config import load_config
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.embeddings.sequences import model_inputs
from models.inference.bundle import load_bundle, predict
from models.tracking.registry.flat import to_frame, to_training_set
from models.tracking.registry.scoring import batch_builder
from models.training.data import USER_VOCAB_ROW, TrainingSet
from models.training.train import train
from tests.models.fixtures import tiny_set_path

TINY = {
    "optim.epochs": 1,
    "optim.batch_size": 64,
    "user_model.d_model": 16,
    "user_model.num_layers": 1,
    "user_model.num_heads": 2,
    "user_model.max_history": 32,
    "ranker.d_model": 16,
    "ranker.num_heads": 2,
    "ranker.recent_events": 16,
    "ranker.use_user_tokens": False,
}


def _huge(ids: np.ndarray, kind: str) -> np.ndarray:
    """Text ids as the importer stores them (63-bit hashes): ``u_<id>`` / ``SKU-<id>``."""
    return np.array([text_id(f"{kind}{int(i)}") for i in ids], np.int64)


def _rewrite_ids(src: Path, dst: Path) -> None:
    """The tiny set with every user / ad id replaced by its hashed text id, plus its vocabulary."""
    shutil.copytree(src, dst)
    for name in ("examples.parquet", "ranker.parquet", "items.parquet", "sequences.parquet"):
        if not (dst / name).exists():
            continue
        table = pq.read_table(dst / name)
        for column, kind in (("user_id", "u_"), ("ad_id", "SKU-")):
            if column not in table.column_names:
                continue
            col = table.column(column).combine_chunks()
            if pa.types.is_list(col.type):
                values = _huge(col.flatten().to_numpy(), kind)
                new = pa.ListArray.from_arrays(col.offsets, pa.array(values, pa.int64()))
            else:
                new = pa.array(_huge(col.to_numpy(), kind), pa.int64())
            table = table.set_column(table.column_names.index(column), column, new)
        pq.write_table(table, dst / name)
    seq = pq.read_table(dst / "sequences.parquet").to_pandas()
    events = seq.explode("ad_id")  # every history event (the tiny set's histories are its training data)
    events = events.assign(ad_id=events["ad_id"].astype(np.int64))[["user_id", "ad_id"]]
    save_vocabularies(build_vocabularies(events, VocabularyConfig(min_count=1)), dst)


@pytest.fixture(scope="module")
def huge_ws(tmp_path_factory) -> Workspace:
    ws = Workspace(tmp_path_factory.mktemp("huge-ids"))
    _rewrite_ids(tiny_set_path(), ws.training("huge"))
    return ws


def test_tables_are_sized_by_the_vocabulary_not_the_largest_id(huge_ws):
    data = TrainingSet(huge_ws.training("huge"))
    small = TrainingSet(tiny_set_path())
    assert data.examples["user_id"].max() > 2**40  # raw ids stay raw (splits and metrics group by them)
    assert data.vocab["user_id"] == small.examples["user_id"].nunique()
    assert data.vocab["ad_id"] <= small.vocab["ad_id"]
    rows = data.examples["ad_id"].to_numpy()
    assert ((rows >= 0) & (rows < data.vocab["ad_id"]) | (rows == OOV)).all()
    assert data.seq_values["ad_id"].max() < data.vocab["ad_id"]
    assert data.examples[USER_VOCAB_ROW].max() < data.vocab["user_id"]


@pytest.mark.integration  # two real (tiny, 1-epoch) trainings
def test_both_models_train_on_hashed_ids_and_the_bundle_maps_like_training(huge_ws):
    for kind in ("user", "ranker"):
        cfg = load_config(
            TrainRunConfig,
            None,
            {**TINY, "model": kind, "training_set": "huge", "output_dir": str(huge_ws.root / "runs" / kind)},
        )
        result = train(cfg, huge_ws)
        assert np.isfinite(result.metrics["valid_ne"])
    bundle = load_bundle(huge_ws.root / "runs" / "user")
    data = TrainingSet(huge_ws.training("huge"))
    assert set(bundle.vocabularies) == {"user_id", "ad_id"}
    assert bundle.vocab["ad_id"] == data.vocab["ad_id"]
    # the refresh maps a user's raw history and id exactly as the training set did
    row = int(np.flatnonzero(data.examples["cut"].to_numpy() > 3)[0])
    u, cut = int(data.examples["user_row"].iat[row]), int(data.examples["cut"].iat[row])
    start = data.seq_offsets[u] + max(0, cut - 32)
    raw_ads = data.raw_ids["seq_ad_id"][start : data.seq_offsets[u] + cut]
    history = data.history(np.array([row]), 32, bundle.cfg.time_buckets, gap_to="previous")
    raw_history = dataclasses.replace(history, ad_id=torch.from_numpy(raw_ads))
    mapped, user = model_inputs(bundle, raw_history, data.raw_ids["user_id"][row : row + 1])
    assert torch.equal(mapped.ad_id, history.ad_id)
    assert user.tolist() == data.examples[USER_VOCAB_ROW].to_numpy()[row : row + 1].tolist()
    # the registered model's row format carries raw ids, and scoring it maps them as training did
    ranker = load_bundle(huge_ws.root / "runs" / "ranker")
    data = TrainingSet(huge_ws.training("huge"), require_ranker=True)
    rows = data.split_rows("test")[:8]
    frame = to_frame(data, rows, ranker.cfg.recent_events)
    assert frame["ad_id"].min() > 2**40 and min(min(h) for h in frame["hist_ad_id"] if h) > 2**40
    direct = predict(ranker.model, batch_builder(ranker, data), rows, 64)
    flat = to_training_set(frame, huge_ws.root / "flat")
    np.testing.assert_allclose(
        predict(ranker.model, batch_builder(ranker, flat), np.arange(len(rows)), 64), direct, rtol=1e-5
    )
