"""The workspace's MLflow store on real SQLite: created under the workspace, re-pointed when the workspace moves."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from gemflow.workspace import Workspace
from models.tracking import mlflow_store

pytestmark = pytest.mark.integration  # real MLflow on SQLite: each new store runs its migrations (~4 s)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """Commands run from a directory that is not the workspace; nothing may land in it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return cwd


def test_a_new_store_keeps_everything_under_the_workspace(tmp_path, elsewhere):
    ws = Workspace(tmp_path / "ws")
    store = mlflow_store.resolve(ws)
    assert store.tracking_uri == f"sqlite:///{ws.mlflow / 'mlflow.db'}"
    client = MlflowClient(store.tracking_uri)
    default = client.get_experiment("0")  # even runs started without an experiment stay in the workspace
    assert default.artifact_location == f"{mlflow_store.artifact_root(ws)}/0"
    exp = mlflow_store.experiment_id(client, "gemflow", store)
    assert client.get_experiment(exp).artifact_location == mlflow_store.artifact_root(ws)
    assert list(elsewhere.iterdir()) == []


def test_a_moved_workspace_reads_its_artifacts_where_it_now_is(tmp_path, elsewhere):
    old, new = Workspace(tmp_path / "old"), Workspace(tmp_path / "new")
    store = mlflow_store.resolve(old)
    client = MlflowClient(store.tracking_uri)
    run = client.create_run(mlflow_store.experiment_id(client, "gemflow", store))
    note = tmp_path / "note.txt"
    note.write_text("lives in the workspace")
    client.log_artifact(run.info.run_id, str(note))
    shutil.copytree(old.root, new.root)
    shutil.rmtree(old.root)

    moved = MlflowClient(mlflow_store.resolve(new).tracking_uri)
    assert moved.get_run(run.info.run_id).info.artifact_uri.startswith(mlflow_store.artifact_root(new) + "/")
    got = moved.download_artifacts(run.info.run_id, "note.txt", str(tmp_path))
    assert Path(got).read_text() == "lives in the workspace"
    # re-pointed once: a second look finds nothing to move
    assert mlflow_store.relocate(new.mlflow / "mlflow.db", mlflow_store.artifact_root(new)) is None


def test_a_configured_server_keeps_its_own_artifact_root(tmp_path, monkeypatch):
    ws = Workspace(tmp_path / "ws")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.gemflow.svc:5000")
    assert mlflow_store.resolve(ws) == mlflow_store.Store("http://mlflow.gemflow.svc:5000", None)
    explicit = mlflow_store.resolve(ws, f"sqlite:///{tmp_path / 'other.db'}")
    # a local database has no server to own artifacts: they go to the workspace
    assert explicit.artifact_root == mlflow_store.artifact_root(ws)
    assert not ws.mlflow.exists()  # the workspace's own store is not created when another is configured


def test_activate_does_not_export_the_uri_to_later_workspaces(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first, second = Workspace(tmp_path / "a"), Workspace(tmp_path / "b")
    try:
        mlflow_store.use(first)
        assert mlflow.get_tracking_uri() == mlflow_store.embedded_uri(first)
        assert mlflow_store.resolve(second).tracking_uri == mlflow_store.embedded_uri(second)
    finally:
        mlflow.set_tracking_uri(None)  # this process's MLflow back to unset
