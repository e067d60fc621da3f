"""The sweep's valid subsample: n valid examples kept, train and test untouched, idempotent, named errors."""

from __future__ import annotations

import pandas as pd
import pytest

from models.scaling.valid_split import DROPPED, subsample_valid
from models.training.data import TrainingSet
from tests.models.fixtures import write_training_set


@pytest.fixture
def src(workspace):
    return write_training_set(workspace.training("fx"), num_users=30, num_ads=40, num_categories=6, seed=5)


def test_keeps_n_valid_examples_and_every_train_and_test_example(src, tmp_path):
    before = pd.read_parquet(src / "examples.parquet")
    n_valid = int((before["split"] == "valid").sum())
    n = n_valid // 3
    dst = subsample_valid(src, tmp_path / "valid", n)
    after = pd.read_parquet(dst / "examples.parquet")
    assert (after["example_id"].to_numpy() == before["example_id"].to_numpy()).all()
    assert (after["split"] == "valid").sum() == n
    assert (after["split"] == DROPPED).sum() == n_valid - n
    for split in ("train", "test"):
        assert ((after["split"] == split) == (before["split"] == split)).all()
    data = TrainingSet(dst)  # the trainer reads the derived set and sees only the kept valid rows
    assert (
        len(data.split_rows("valid")) == n
        and len(data.split_rows("train")) == (before["split"] == "train").sum()
    )
    # same request -> same folder, untouched; a set with few valid examples is returned as is
    stamp = (dst / "examples.parquet").stat().st_mtime_ns
    assert subsample_valid(src, tmp_path / "valid", n) == dst
    assert (dst / "examples.parquet").stat().st_mtime_ns == stamp
    assert subsample_valid(src, tmp_path / "all", n_valid) == src


def test_zero_is_a_named_error(src, tmp_path):
    with pytest.raises(ValueError, match="valid_examples"):
        subsample_valid(src, tmp_path / "valid", 0)
