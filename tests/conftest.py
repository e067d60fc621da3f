"""Shared fixtures: repo paths, the shared datasets (skipped cleanly when absent), a fresh workspace; under
``CI=true`` a skip fails unless the test is marked gpu (``tests/ci_strict.py``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

import features  # noqa: F401 (first: Feast then imports without typeguard's cost, features.feast_import)
from gemflow.workspace import Workspace

pytest_plugins = ["tests.ci_strict", "pytester"]

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
# `gemflow up` records the running MLflow UI under $XDG_STATE_HOME (gemflow.running_ui): tests keep theirs out of
# the user's home, one folder per test process
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="gemflow-test-state-")


# The longest test files (minutes each on 2 cores), run first: under `make test` (pytest-xdist, 2 workers, whole
# files per worker) one worker starts the platform's pipeline pass at once while the other takes the rest,
# instead of it starting last and running alone.
LONGEST_FIRST = (
    "tests/platform/",
    "tests/dags/test_pipeline_dags.py",
    "tests/models/distributed/test_launch.py",
    "tests/models/registry/test_lineage.py",
    "tests/serving/test_rollout.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next(
            (i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
            len(LONGEST_FIRST),
        )

    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def movielens_dir() -> Path:
    path = SHARED_DATA / "movielens-100k"
    if not (path / "ml-100k.inter.gz").exists():
        pytest.skip(f"MovieLens-100K not found at {path} (it lives in ../shared/data, never in the repo)")
    return path


@pytest.fixture
def workspace(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path / "ws")
