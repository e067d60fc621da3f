"""A workspace's runs reach the MLflow UI that ``gemflow up`` started (issue 34, point 4).

The platform's MLflow server is started exactly as ``gemflow up`` starts it (``Platform.mlflow_command``, recorded
in the workspace's platform state and in ``gemflow.running_ui``); a training run's tracking on that workspace is
then read back through the server's REST API, which is what its UI calls. A command on another workspace keeps
its own store (its registry would otherwise take the platform's model names) and says, once, where its runs are
and how to see them.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import urllib.request
import uuid

import pytest
from mlflow import MlflowClient

from gemflow import running_ui
from gemflow.platform import Platform
from gemflow.platform_env import PlatformConfig
from gemflow.workspace import Workspace
from models.config import TrackingConfig
from models.tracking import mlflow_store
from models.tracking.registry.server import server_command
from models.tracking.training_run import Tracker
from tests.ports import free_port


@pytest.fixture
def platform_mlflow(tmp_path, monkeypatch):
    """The platform's MLflow server on a workspace, recorded as ``gemflow up`` records it."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    platform = Platform(Workspace(tmp_path / "platform-ws"), PlatformConfig(mlflow_port=free_port()))
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    svc = platform._start("mlflow", platform.mlflow_command(server_command), env, platform.mlflow_url)
    platform._write_state({"marker": uuid.uuid4().hex, "config": {}, "services": [svc.__dict__]})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{platform.mlflow_url}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, (platform.logs / "mlflow.log").read_text()[-2000:]
                time.sleep(0.5)
        running_ui.record(platform.ws.root, platform.mlflow_url)
        yield platform
    finally:
        os.killpg(svc.pgid, signal.SIGTERM)


@pytest.mark.integration
def test_a_run_on_the_platforms_workspace_is_in_its_mlflow_ui(platform_mlflow, caplog):
    ws = platform_mlflow.ws
    with caplog.at_level(logging.WARNING, logger="models.tracking.mlflow_store"):
        tracker = Tracker(TrackingConfig(experiment="shop-ranker"), ws, "first-day")
        tracker.log_metrics({"valid_ne": 0.96}, step=1)
        tracker.end()
    notes = [r for r in caplog.records if "MLflow UI" in r.getMessage()]
    assert not notes  # the UI reads this very store: nothing to say

    ui = MlflowClient(platform_mlflow.mlflow_url)  # the server's REST API: what its UI reads
    experiment = ui.get_experiment_by_name("shop-ranker")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    [run] = ui.search_runs([experiment.experiment_id])
    assert run.info.run_id == tracker.run_id and run.data.metrics == {"valid_ne": 0.96}


@pytest.mark.integration
def test_a_command_on_another_workspace_says_where_its_runs_are(platform_mlflow, tmp_path, caplog):
    other = Workspace(tmp_path / "shop-ws")
    with caplog.at_level(logging.WARNING, logger="models.tracking.mlflow_store"):
        store = mlflow_store.resolve(other)
        mlflow_store.resolve(other)  # said once per process
    assert store.tracking_uri == mlflow_store.embedded_uri(other)  # its own store, not the platform's
    [note] = [r.getMessage() for r in caplog.records if "MLflow UI" in r.getMessage()]
    assert platform_mlflow.mlflow_url in note and str(platform_mlflow.ws.root.resolve()) in note
    assert f"gemflow up -w {other.root.resolve()}" in note

    running_ui.forget(platform_mlflow.ws.root)  # what `gemflow down` does
    assert running_ui.running() is None
