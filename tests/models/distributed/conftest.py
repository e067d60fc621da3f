"""Shared pieces of the distributed-training tests: a small planted training set and a run config."""

from __future__ import annotations

from pathlib import Path

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
    }
    return load_config(TrainRunConfig, None, {**base, **{k: str(v) for k, v in overrides.items()}})


@pytest.fixture(scope="session")
def training_set(tmp_path_factory) -> Path:
    return write_training_set(tmp_path_factory.mktemp("dist") / "training" / "small", num_users=60, seed=0)
