"""A leave-one-out training set built from the planted sequence log (import -> offline store -> build; the
validation gate and Feast are left out here: the whole-path test in test_pipeline.py runs them)."""

from __future__ import annotations

import datetime as dt

import pandas as pd
import pyarrow.parquet as pq
import pytest

from features.ingestion.offline import write_accepted
from features.sources.sequences import import_sequences
from features.training_sets import TrainingSetConfig, build_training_set
from gemflow.workspace import Workspace
from tests.models.sequential.fixtures import write_sequence_log


def land_without_gate(ws: Workspace, day: dt.date) -> None:
    frames = {t: pq.read_table(ws.raw(t, day)).to_pandas() for t in ("users", "ads", "events")}
    write_accepted(ws, day, {t: pd.DataFrame(f) for t, f in frames.items()})


@pytest.fixture(scope="session")
def loo_set(tmp_path_factory) -> tuple[Workspace, str]:
    root = tmp_path_factory.mktemp("sequential")
    ws = Workspace(root / "ws")
    log, attributes = write_sequence_log(root / "log")
    summary = import_sequences(log, ws, item_attributes=attributes, progress=False)
    land_without_gate(ws, dt.date.fromisoformat(summary["first_day"]))
    build_training_set(ws, TrainingSetConfig(name="loo", split="leave-one-out", join_features=False))
    return ws, "loo"
