"""Lineage: a ranker trained in a workspace and registered with ``gemflow register-run`` on the embedded store.

The registered version's source run is the training run (params, learning curves, plots); the gate's figures and
decision are metrics and params of the logged model; every run, model and artifact lives under the workspace
(nothing in ``./mlruns`` of the directory the commands ran in); a copied workspace whose original is deleted
still serves its champion.
"""

from __future__ import annotations

import json
import os
import shutil
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
from models.tracking.registry.flat import to_frame
from models.tracking.registry.gate import logged_model_id
from models.tracking.training_run import RUN_RECORD, recorded_run_id
from models.training.data import TrainingSet
from models.training.train import train
from serving.model_source import load_served_model
from tests.models.fixtures import write_training_set

pytestmark = pytest.mark.integration  # a real training run and MLflow on SQLite (~30 s on 2 shared cores)
NAME = "gem-ranker"
SMALL = {"training_set": "fx", "model": "ranker", "optim.epochs": 2, "optim.batch_size": 32,
         "ranker.d_model": 16, "ranker.num_heads": 2, "ranker.recent_events": 16,
         "ranker.use_user_tokens": False}  # fmt: skip
LOOSE = ["--calibration-low", "0.01", "--calibration-high", "100"]  # tiny data: any calibration passes


def register(ws: Workspace, *args: str):
    return CliRunner().invoke(app, ["register-run", "--kind", "ranker", "-w", str(ws.root), *LOOSE, *args])


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """Train in a workspace, then register the run from another directory (whose ./mlruns must stay empty)."""
    root = tmp_path_factory.mktemp("lineage")
    ws = Workspace(root / "ws")
    write_training_set(ws.training("fx"), num_users=60, num_ads=40, num_categories=6, seed=7)
    elsewhere = root / "cwd"
    elsewhere.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(elsewhere)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        run_dir = ws.root / "models" / "ranker" / "r1"
        train(load_config(TrainRunConfig, None, {**SMALL, "output_dir": str(run_dir)}), ws)
        result = register(ws, "--run-dir", str(run_dir))
    assert result.exit_code == 0 and "PROMOTED" in result.output, result.output
    return ws, run_dir, elsewhere


def client_of(ws: Workspace) -> MlflowClient:
    return MlflowClient(mlflow_store.resolve(ws).tracking_uri)


def under(location: str, root: str) -> bool:
    return location == root or location.startswith(root + "/")


def test_source_run_is_the_training_run_with_params_and_curves(registered):
    ws, run_dir, _ = registered
    client = client_of(ws)
    mv = client.get_model_version_by_alias(NAME, "champion")
    assert mv.run_id == recorded_run_id(run_dir)
    run = client.get_run(mv.run_id)
    assert run.data.params["ranker.d_model"] == "16" and run.data.params["optim.epochs"] == "2"
    assert len(client.get_metric_history(run.info.run_id, "valid_ne")) == 3  # untrained + 2 epochs
    assert {"learning_curve.png", "config.yaml"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert run.info.status == "FINISHED"
    model = client.get_logged_model(logged_model_id(mv))
    assert model.source_run_id == run.info.run_id


def test_the_logged_model_carries_the_best_epochs_metrics_and_the_training_set(registered):
    """MLflow 3 links a run's metrics of one step to the model logged in it: the best evaluation's step, not the
    untrained model's step 0; the run's input is its training set; the experiment is a model-training one."""
    ws, run_dir, _ = registered
    client = client_of(ws)
    mv = client.get_model_version_by_alias(NAME, "champion")
    model = client.get_logged_model(logged_model_id(mv))
    run = client.get_run(mv.run_id)
    history = json.loads((run_dir / "history.json").read_text())
    best = min(history, key=lambda h: h["valid_ne"])
    linked = {m.key: m for m in model.metrics if not m.key.startswith("gate.")}
    assert linked["valid_ne"].value == pytest.approx(best["valid_ne"], rel=1e-6)
    assert linked["valid_ne"].step == best["epoch"] == int(run.data.tags["gemflow.best_step"])
    assert linked["valid_auc"].value == pytest.approx(best["valid_auc"], rel=1e-6)
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == [
        "fx"
    ]  # one dataset: training's = registration's
    # the model's "Datasets used" (the UI lists its metrics' datasets): the run's training set, same digest
    trained_on = run.inputs.dataset_inputs[0].dataset
    assert {(m.dataset_name, m.dataset_digest) for m in linked.values()} == {
        (trained_on.name, trained_on.digest)
    }
    assert [i.tags[0].value for i in run.inputs.dataset_inputs] == ["training"]  # mlflow.data.context
    assert str(model.status) == "READY"
    assert [(o.model_id, o.step) for o in run.outputs.model_outputs] == [(model.model_id, best["epoch"])]
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_gate_figures_are_metrics_and_params_of_the_logged_model(registered):
    ws, _, _ = registered
    client = client_of(ws)
    mv = client.get_model_version_by_alias(NAME, "champion")
    model = client.get_logged_model(logged_model_id(mv))
    figures = {m.key: m.value for m in model.metrics}
    assert {"gate.ne", "gate.calibration", "gate.auc"} <= set(figures), figures
    assert figures["gate.promoted"] == 1.0
    # the version tag stays, for the registry UI
    assert figures["gate.ne"] == pytest.approx(float(mv.tags["gate.ne"]), rel=1e-5)
    assert model.params["gate.decision"] == "promoted" and model.params["gate.reason"] == "no champion yet"
    assert model.params["gate.compared_to"] == "none"


def test_everything_lives_under_the_workspace(registered):
    ws, _, elsewhere = registered
    client = client_of(ws)
    root = mlflow_store.artifact_root(ws)
    mv = client.get_model_version_by_alias(NAME, "champion")
    run = client.get_run(mv.run_id)
    locations = [e.artifact_location for e in client.search_experiments()]
    locations += [run.info.artifact_uri, client.get_logged_model(logged_model_id(mv)).artifact_location]
    assert all(under(loc, root) for loc in locations), locations
    assert not (elsewhere / "mlruns").exists() and not (elsewhere / "mlflow.db").exists()


def test_register_by_run_id_and_clear_errors(registered, tmp_path):
    ws, run_dir, _ = registered
    run_id = recorded_run_id(run_dir)
    # the same run again (a retried task): its version is reused and judged as before, no second version
    again = register(ws, "--run-id", run_id)
    assert again.exit_code == 0 and "v1 from" in again.output, again.output
    assert "no champion yet" in again.output, again.output
    client = client_of(ws)
    versions = client.search_model_versions(f"name='{NAME}' and run_id='{run_id}'")
    assert [str(v.version) for v in versions] == ["1"]
    assert dict(client.get_registered_model(NAME).aliases).keys() == {"champion"}
    model = client.get_logged_model(logged_model_id(client.get_model_version(NAME, "1")))
    assert model.params["gate.decision"] == "promoted"

    bare = tmp_path / "bare"
    shutil.copytree(run_dir, bare)
    (bare / RUN_RECORD).unlink()
    result = register(ws, "--run-dir", str(bare))
    assert result.exit_code == 2 and f"records no MLflow run ({RUN_RECORD} is missing)" in result.output
    result = register(ws, "--run-id", "0" * 32)
    assert result.exit_code == 2 and f"no MLflow run {'0' * 32}" in result.output, result.output


def test_moved_workspace_serves_its_champion(registered, tmp_path):
    ws, _, _ = registered
    first, moved = Workspace(tmp_path / "first"), Workspace(tmp_path / "moved")
    shutil.copytree(ws.root, first.root)
    mlflow_store.resolve(first)  # the copy is used once where it was copied to ...
    shutil.copytree(first.root, moved.root)
    shutil.rmtree(first.root)  # ... then moved on: nothing is left at the first place

    served = load_served_model(f"models:/{NAME}@champion", ws=moved)  # as the model server loads it
    assert served.version == f"{NAME}/1"
    data = TrainingSet(moved.training("fx"))
    example = to_frame(data, data.split_rows("test")[:5], served.cfg.recent_events)
    scores = mlflow.pyfunc.load_model(f"models:/{NAME}@champion").predict(example)
    assert len(scores) == 5 and scores["p_click"].between(0, 1).all()
    client = client_of(moved)
    mv = client.get_model_version_by_alias(NAME, "champion")
    root = mlflow_store.artifact_root(moved)
    assert under(client.get_logged_model(logged_model_id(mv)).artifact_location, root)
    assert under(client.get_run(mv.run_id).info.artifact_uri, root)


CHILD = """
import json, sys
import mlflow
from mlflow.models import Model
path = sys.argv[1]
model = mlflow.pyfunc.load_model(path)
example = Model.load(path).load_input_example(path)
import models
print(json.dumps({"p_click": model.predict(example)["p_click"].tolist(), "models": models.__file__}))
"""


def test_logged_model_loads_in_a_fresh_venv_from_its_declared_requirements(registered, tmp_path):
    """Only the model's files: a venv with its requirements.txt (no system site-packages), the repo off sys.path."""
    ws, _, _ = registered
    client = client_of(ws)
    mv = client.get_model_version_by_alias(NAME, "champion")
    path = Path(client.get_logged_model(logged_model_id(mv)).artifact_location.removeprefix("file://"))
    requirements = (path / "requirements.txt").read_text().split()
    names = {r.split("==")[0] for r in requirements}
    assert {"torch", "torchrec", "fbgemm-gpu-cpu", "mlflow-skinny"} <= names
    assert {p.name for p in (path / "code").iterdir()} >= {"models", "gemflow", "features"}

    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, cwd=tmp_path)
    started = time.perf_counter()
    subprocess.run(  # exact pins, no resolver: torchrec names the CUDA fbgemm-gpu (models.tracking.registry.environment)
        [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "-r", path / "requirements.txt"],
        check=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    took = time.perf_counter() - started
    print(f"fresh venv: {len(requirements)} pinned packages installed in {took:.0f} s")
    out = subprocess.run(
        [venv / "bin" / "python", "-I", "-c", CHILD, str(path)],
        check=True, cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    child = json.loads(out.stdout.strip().splitlines()[-1])
    # the model's own copy of the code, not the repo
    assert Path(child["models"]).is_relative_to(path / "code"), child["models"]
    model = mlflow.pyfunc.load_model(str(path))
    expected = model.predict(model.metadata.load_input_example(str(path)))["p_click"]
    assert child["p_click"] == pytest.approx(expected.tolist(), abs=1e-6)
