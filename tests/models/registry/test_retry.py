"""Registration is safe to retry: a killed MLflow tracking server fails ``gemflow register-run`` clearly, and the
retry registers no second version of the training run and gates it as the first attempt would have.

The unit tests use a SQLite store in a temp folder and hand-made versions (no training); the integration test
trains a tiny ranker through a real ``mlflow server`` (over the workspace's store, as ``gemflow mlflow-server``
runs it), SIGKILLs the server's process group, and registers again after restarting it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from gemflow.cli import app
from gemflow.config import load_config
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.tracking import mlflow_store
from models.tracking.registry import register_bundle, run_gate
from models.tracking.registry.gate import GateConfig
from models.tracking.registry.logging import BUNDLE_HASH_TAG, existing_version
from models.tracking.registry.server import start_server
from models.tracking.training_run import recorded_run_id
from models.training.train import train
from tests.models.fixtures import write_training_set
from tests.models.registry.test_lineage import LOOSE, NAME, SMALL
from tests.ports import free_port


# ------------------------------------------------------------------------------------- unit: reuse and re-gate
@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh SQLite store as this process's MLflow store, with one finished run."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow_store.activate(uri)
    client = MlflowClient(uri)
    experiment = client.create_experiment("retry", artifact_location=(tmp_path / "art").as_uri())
    run = client.create_run(experiment)
    client.set_terminated(run.info.run_id)
    yield client, experiment, run.info.run_id
    mlflow.set_tracking_uri(None)


def add_version(client, experiment: str, run_id: str, digest: str = "abc", name: str = NAME) -> str:
    """What ``log_model(registered_model_name=...)`` leaves: a logged model in the run, a version created from it."""
    model = client.create_logged_model(experiment, source_run_id=run_id, tags={BUNDLE_HASH_TAG: digest})
    if not client.search_registered_models(f"name='{name}'"):
        client.create_registered_model(name)
    return str(client.create_model_version(name, f"models:/{model.model_id}", run_id=run_id).version)


def test_existing_version_is_the_runs_ready_version_with_the_same_bundle(store):
    client, experiment, run_id = store
    assert existing_version(client, NAME, run_id, "abc") is None  # no registered model yet
    other = client.create_run(experiment).info.run_id
    add_version(client, experiment, other)  # another run's version
    assert existing_version(client, NAME, run_id, "abc") is None
    v2 = add_version(client, experiment, run_id)
    assert str(existing_version(client, NAME, run_id, "abc").version) == v2
    assert existing_version(client, NAME, run_id, "other weights") is None  # model.pt changed since


def test_register_bundle_reuses_the_version_without_logging_again(store, tmp_path, monkeypatch):
    client, experiment, run_id = store
    version = add_version(client, experiment, run_id)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "model.pt").write_bytes(b"weights")
    from models.tracking.registry import logging as registry_logging

    bundle = type("B", (), {"kind": "ranker", "user_model_version": "gem-user-model/3"})()
    monkeypatch.setattr(registry_logging, "recorded_run_id", lambda _: run_id)
    monkeypatch.setattr(registry_logging, "load_bundle", lambda _: bundle)
    monkeypatch.setattr(registry_logging, "bundle_hash", lambda _: "abc")
    monkeypatch.setattr(
        registry_logging, "_log_and_register", lambda *a: pytest.fail("logged a second model")
    )
    again = register_bundle(run_dir, tmp_path / "set")
    assert (again.name, again.version, again.run_id) == (NAME, version, run_id)
    tags = client.get_model_version(NAME, version).tags
    assert tags["gemflow.training_set"] == str(tmp_path / "set")  # the tags the first attempt never set
    assert tags["gemflow.user_model_version"] == "gem-user-model/3"


def aliases(client) -> dict[str, str]:
    return {k: str(v) for k, v in client.get_registered_model(NAME).aliases.items()}


def test_gate_rerun_gives_the_same_decision_and_moves_no_alias(store):
    client, experiment, run_id = store
    figures = {"1": {"ne": 0.9, "calibration": 1.0}, "2": {"ne": 0.8, "calibration": 1.0}}
    judge = lambda uri: figures[uri.rsplit("/", 1)[1]]  # noqa: E731
    v1, v2 = add_version(client, experiment, run_id), add_version(client, experiment, run_id)
    assert run_gate(NAME, v1, judge, GateConfig(), client).reason == "no champion yet"
    first = run_gate(NAME, v2, judge, GateConfig(), client)
    assert first.promoted and aliases(client) == {"champion": v2}

    moves = []
    original = client.set_registered_model_alias
    client.set_registered_model_alias = lambda *a: (moves.append(a), original(*a))
    again = run_gate(
        NAME, v2, judge, GateConfig(), client
    )  # v2 is @champion already: judged against v1 again
    assert (again.promoted, again.reason, again.champion_version) == (True, first.reason, v1)
    assert moves == [] and aliases(client) == {"champion": v2}
    assert client.get_model_version(NAME, v2).tags["gate.previous_champion"] == v1  # not itself

    original(NAME, "challenger", v2)  # a first run that died between @champion and removing @challenger
    assert run_gate(NAME, v2, judge, GateConfig(), client).promoted
    assert moves == [] and aliases(client) == {"champion": v2}

    figures["3"] = {"ne": 0.95, "calibration": 1.0}  # a rejected version, gated again: the same answer
    v3 = add_version(client, experiment, run_id)
    rejected = [run_gate(NAME, v3, judge, GateConfig(), client) for _ in range(2)]
    assert [d.promoted for d in rejected] == [False, False] and rejected[0].reason == rejected[1].reason
    assert aliases(client) == {"champion": v2, "challenger": v3}


def test_unreachable_is_a_server_that_did_not_answer(store, monkeypatch):
    client = MlflowClient(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(mlflow.exceptions.MlflowException) as down:
        client.get_run("0" * 32)
    assert mlflow_store.unreachable(down.value)
    assert "(Connection refused)" in mlflow_store.unreachable_message(down.value, "http://x")
    with pytest.raises(mlflow.exceptions.MlflowException) as missing:
        store[0].get_run("0" * 32)  # an answer: no such run
    assert not mlflow_store.unreachable(missing.value)


# ------------------------------------------------------------------- integration: a real server, SIGKILLed
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A workspace whose store a real MLflow server serves, and a tiny ranker trained through that server."""
    root = tmp_path_factory.mktemp("retry")
    ws = Workspace(root / "ws")
    write_training_set(ws.training("fx"), num_users=60, num_ads=40, num_categories=6, seed=7)
    mlflow_store.open_embedded(ws)  # as `gemflow mlflow-server` does
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [start_server(ws.mlflow, port=port, new_session=True)]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(root)
        run_dir = ws.root / "models" / "ranker" / "r1"
        overrides = {**SMALL, "output_dir": str(run_dir), "tracking.tracking_uri": url}
        train(load_config(TrainRunConfig, None, overrides), ws)
        yield ws, run_dir, url, port, procs
    mlflow.set_tracking_uri(None)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def cli(ws: Workspace, url: str, run_dir: Path) -> list[str]:
    return ["register-run", "--kind", "ranker", "-w", str(ws.root), "--tracking-uri", url,
            "--run-dir", str(run_dir), *LOOSE]  # fmt: skip


@pytest.mark.integration
def test_killed_server_fails_clearly_and_the_retry_registers_one_version(served, monkeypatch, caplog):
    ws, run_dir, url, port, procs = served
    run_id = recorded_run_id(run_dir)
    mlflow_store.activate(url)
    client = MlflowClient(url)
    assert client.get_run(run_id).info.status == "FINISHED"  # trained through the server

    # a first attempt that registered the version, then died before the gate
    first = register_bundle(run_dir, ws.training("fx"))
    assert first.run_id == run_id and not aliases(client)

    os.killpg(procs[0].pid, signal.SIGKILL)
    procs[0].wait(timeout=10)
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    env.pop("MLFLOW_TRACKING_URI", None)
    started = time.perf_counter()
    down = subprocess.run([Path(sys.executable).with_name("gemflow"), *cli(ws, url, run_dir)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    took = time.perf_counter() - started
    errors = [line for line in down.stderr.splitlines() if line.startswith("error:")]
    print(f"register-run with the server killed: exit {down.returncode} in {took:.1f} s: {errors}")
    assert down.returncode == 1, down.stderr
    assert errors == [f"error: the MLflow tracking server {url} did not answer (Connection refused); "
                      "a retry reuses any version this attempt registered"], down.stderr  # fmt: skip
    assert "Traceback" not in down.stderr
    assert took < 60

    procs.append(start_server(ws.mlflow, port=port, new_session=True))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with caplog.at_level(logging.INFO, logger="models.tracking.registry.logging"):
        retry = CliRunner().invoke(app, cli(ws, url, run_dir))
    assert retry.exit_code == 0, retry.output
    assert f"{NAME} v{first.version} is already registered from training run {run_id}" in caplog.text
    assert f"{NAME} v{first.version} from {run_dir}: PROMOTED to @champion: no champion yet" in retry.output
    versions = client.search_model_versions(f"name='{NAME}'")
    assert [(str(v.version), v.run_id) for v in versions] == [(first.version, run_id)]  # no second version
    assert aliases(client) == {"champion": first.version}
    tags = client.get_model_version(NAME, first.version).tags
    assert tags["gate.decision"] == "promoted" and tags["gemflow.training_set"] == str(ws.training("fx"))
