"""Shared pieces of the distributed-training tests: a small planted training set and a run config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from gemflow.config import load_config
from models.config import TrainRunConfig
from tests.models.fixtures import write_training_set


def small_config(training_set: Path, **overrides) -> TrainRunConfig:
    """d_model 64, 2 layers, MLflow off: the shape every distributed test shares."""
    base = {
        "training_set": str(training_set),
        "tracking.enabled": "false",
        "user_model.d_model": "64",
        "user_model.max_history": "64",
        "optim.log_every": "5",
        # the fixture's tables are tiny: keep the ad (81 rows) and user tables sharded, as at production scale,
        # so every test runs both the sharded and the replicated embedding path
        "distributed.replicate_max_rows": "40",
    }
    return load_config(TrainRunConfig, None, {**base, **{k: str(v) for k, v in overrides.items()}})


def write_learnable_set(out: Path, num_users: int, seed: int = 0) -> Path:
    """The fixture training set with labels re-drawn from a strong, history-dependent rule.

    click ~ Bernoulli(sigmoid(-1.5 + 3 * [candidate category among the user's last 10 events] + 1.5 * quality')),
    so a model that reads the history against the candidate gets well below NE 1 within a few hundred steps:
    NE comparisons between training setups then measure training, not noise around the base rate.
    """
    write_training_set(out, num_users=num_users, seed=seed)
    seqs = pq.read_table(out / "sequences.parquet").to_pydict()
    ex = pd.read_parquet(out / "examples.parquet")
    rng = np.random.default_rng(seed + 1)
    recent = [
        set(seqs["category_id"][u][max(0, c - 10) : c])
        for u, c in zip(ex["user_row"], ex["cut"], strict=True)
    ]
    match = np.array([cat in r for cat, r in zip(ex["category_id"], recent, strict=True)], np.float64)
    logit = -1.5 + 3.0 * match + 1.5 * (2 * ex["quality"].to_numpy() - 1)
    ex["click"] = (rng.uniform(size=len(ex)) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    ex["conversion"] = (ex["click"] * (rng.uniform(size=len(ex)) < 0.3)).astype(np.int64)
    ex.to_parquet(out / "examples.parquet", index=False)
    (out / "ranker.parquet").unlink()  # the user model reads sequences + examples only
    return out


@pytest.fixture(scope="session")
def training_set(tmp_path_factory) -> Path:
    return write_training_set(tmp_path_factory.mktemp("dist") / "training" / "small", num_users=60, seed=0)
