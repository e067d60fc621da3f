"""The champion/challenger gate against a real MLflow tracking server over HTTP.

A worse model stays @challenger with the reason tagged; a better one becomes @champion; rollback restores the
previous champion; the server's REST API lists the experiment, metrics, plots and registered versions.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.inference.bundle import predict
from models.tracking.registry import GateConfig, load_registered, register_bundle, rollback, run_gate
from models.tracking.registry.flat import to_frame
from models.tracking.registry.gate import decide
from models.tracking.registry.heldout import evaluator
from models.tracking.registry.scoring import batch_builder
from models.tracking.registry.server import start_server
from models.training.data import TrainingSet
from models.training.train import train
from tests.models.fixtures import write_training_set
from tests.ports import free_port

pytestmark = pytest.mark.integration
NAME = "gem-user-model"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    proc = start_server(root, port=port)
    url = f"http://127.0.0.1:{port}"
    previous = os.environ.get("MLFLOW_TRACKING_URI")  # not get_tracking_uri(): unset, it names ./mlflow.db
    mlflow.set_tracking_uri(url)
    yield url
    mlflow.set_tracking_uri(previous)  # None unsets it: no store leaks into later tests
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, server):
    """Three user models on one training set: weak (1 epoch), broken (lr 0: the untrained net), strong."""
    root = tmp_path_factory.mktemp("runs")
    data = write_training_set(root / "set", num_users=60, num_ads=80, seed=3)
    ws = Workspace(root / "ws")

    def run(name: str, epochs: int, lr: float, sparse_lr: float) -> Path:
        cfg = TrainRunConfig(model="user", training_set=str(data), output_dir=str(root / name))
        cfg.user_model.d_model, cfg.user_model.num_layers, cfg.user_model.next_event_weight = 32, 1, 0.0
        cfg.optim.epochs, cfg.optim.lr, cfg.optim.sparse_lr, cfg.optim.patience = epochs, lr, sparse_lr, 10
        cfg.optim.batch_size = 64
        cfg.tracking.tracking_uri, cfg.tracking.experiment, cfg.tracking.run_name = server, "gate-test", name
        train(cfg, ws)
        return root / name

    return data, {
        "weak": run("weak", 1, 3e-4, 0.0),
        "broken": run("broken", 1, 0.0, 0.0),
        "strong": run("strong", 6, 3e-3, 0.05),
    }


def test_gate_promotes_better_rejects_worse_and_rolls_back(server, trained):
    data, runs = trained
    client = MlflowClient()
    judge = evaluator(data)
    loose = GateConfig(min_relative_ne_gain=0.002, calibration_low=0.5, calibration_high=2.0)  # tiny data

    first = register_bundle(runs["weak"], data)
    d1 = run_gate(NAME, first.version, judge, loose)
    assert d1.promoted and d1.reason == "no champion yet"
    assert client.get_model_version_by_alias(NAME, "champion").version == first.version

    worse = register_bundle(runs["broken"], data)
    d2 = run_gate(NAME, worse.version, judge, loose)
    assert not d2.promoted, d2
    assert d2.metrics["ne"] > d2.champion_metrics["ne"]
    tags = client.get_model_version(NAME, worse.version).tags
    assert tags["gate.decision"] == "rejected" and "does not beat champion" in tags["gate.reason"]
    assert client.get_model_version_by_alias(NAME, "challenger").version == worse.version
    assert client.get_model_version_by_alias(NAME, "champion").version == first.version

    better = register_bundle(runs["strong"], data)
    d3 = run_gate(NAME, better.version, judge, loose)
    assert d3.promoted, d3
    assert client.get_model_version_by_alias(NAME, "champion").version == better.version
    assert client.get_model_version(NAME, better.version).tags["gate.previous_champion"] == first.version

    assert rollback(NAME) == first.version
    assert client.get_model_version_by_alias(NAME, "champion").version == first.version
    assert client.get_model_version(NAME, better.version).tags["gate.rolled_back"] == "true"


def test_registered_model_is_pickle_free_and_predicts_like_training(server, trained, monkeypatch):
    data, runs = trained
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false")
    version = register_bundle(runs["strong"], data, name="gem-user-model-io")
    pyfunc = mlflow.pyfunc.load_model(version.uri)
    assert pyfunc.metadata.signature is not None
    bundle = load_registered(version.uri)
    assert bundle.kind == "user"
    ts = TrainingSet(data)
    rows = ts.split_rows("test")[:8]
    out = pyfunc.predict(to_frame(ts, rows, bundle.cfg.max_history))
    direct = predict(bundle.model, batch_builder(bundle, ts), rows, 64)
    assert abs(out["p_click"].to_numpy() - direct[:, 0]).max() < 1e-5
    assert len(out["user_embedding"][0]) == bundle.cfg.num_user_tokens * bundle.cfg.d_model


def test_rest_api_lists_experiment_metrics_plots_and_versions(server, trained):
    def get(path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"{server}/api/2.0/mlflow/{path}", data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    exp = get("experiments/get-by-name?experiment_name=gate-test")["experiment"]
    runs = get("runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 50})
    names = {r["info"]["run_name"]: r for r in runs.get("runs", [])}
    assert {"weak", "broken", "strong"} <= set(names)
    metric_keys = {m["key"] for m in names["strong"]["data"]["metrics"]}
    assert "valid_ne" in metric_keys or any(k.endswith("valid_ne") for k in metric_keys), metric_keys
    arts = get(f"artifacts/list?run_id={names['strong']['info']['run_id']}")
    assert {"learning_curve.png", "calibration.png"} <= {f["path"] for f in arts.get("files", [])}
    assert get(f"registered-models/get?name={NAME}")["registered_model"]["name"] == NAME
    listed = get(f"model-versions/search?filter=name%3D%27{NAME}%27")["model_versions"]
    assert len(listed) >= 3


def test_decide_rules():
    cfg = GateConfig(min_relative_ne_gain=0.01, calibration_low=0.9, calibration_high=1.1)
    assert decide({"ne": 0.8, "calibration": 1.0}, None, cfg) == (True, "no champion yet")
    ok, why = decide({"ne": 0.8, "calibration": 1.3}, None, cfg)
    assert not ok and "calibration" in why
    assert not decide({"ne": 0.795, "calibration": 1.0}, {"ne": 0.8}, cfg)[0]  # 0.6% < 1% margin
    assert decide({"ne": 0.79, "calibration": 1.0}, {"ne": 0.8}, cfg)[0]
