"""Single-process training: learning, early-stopping state, resumable checkpoints, MLflow tracking, CLI."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gemflow.cli import app
from gemflow.config import load_config
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.training.train import CHECKPOINT, train
from tests.models.fixtures import write_training_set

SMALL = {
    "training_set": "fx",
    "optim.epochs": 2,
    "optim.batch_size": 32,
    "optim.patience": 5,
    "user_model.d_model": 16,
    "user_model.num_layers": 1,
    "user_model.num_heads": 2,
    "user_model.max_history": 32,
    "user_model.num_user_tokens": 2,
    "ranker.d_model": 16,
    "ranker.num_heads": 2,
    "ranker.recent_events": 16,
}


@functools.cache
def _workspace(root: str) -> Workspace:
    ws = Workspace(Path(root))
    write_training_set(ws.training("fx"), num_users=60, num_ads=40, num_categories=6, seed=7)
    return ws


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return _workspace(str(tmp_path_factory.mktemp("train-ws")))


@pytest.fixture(scope="module")
def straight(ws):
    cfg = load_config(TrainRunConfig, None, {**SMALL, "output_dir": str(ws.root / "runs" / "straight")})
    return train(cfg, ws)


@pytest.mark.integration  # real training runs and MLflow (~20 s each on 2 shared cores)
def test_two_epochs_improve_validation_ne(straight):
    initial = straight.history[0]["valid_ne"]
    trained = [h["valid_ne"] for h in straight.history[1:]]
    assert len(trained) == 2
    assert min(trained) < initial, straight.history
    assert straight.metrics["valid_ne"] == pytest.approx(min([initial, *trained]), rel=1e-6)
    for name in ("valid_auc", "valid_calibration", "test_ne", "valid_conversion_ne"):
        assert name in straight.metrics


@pytest.mark.integration  # real training runs and MLflow (~20 s each on 2 shared cores)
def test_outputs_next_to_the_model(straight):
    run = straight.run_dir
    for name in (
        "model.pt",
        CHECKPOINT,
        "config.yaml",
        "metrics.json",
        "history.json",
        "learning_curve.png",
        "calibration.png",
    ):
        assert (run / name).exists(), name
    assert json.loads((run / "metrics.json").read_text())["valid_ne"] == pytest.approx(
        straight.metrics["valid_ne"]
    )
    ckpt = torch.load(
        run / CHECKPOINT, map_location="cpu", weights_only=True
    )  # plain tensors and values only
    assert ckpt["state"]["epoch"] == 2 and ckpt["state"]["step"] > 0
    assert ckpt["sparse_optimizer"] and "optimizer" in ckpt and "rng" in ckpt


@pytest.mark.integration  # real training runs and MLflow (~20 s each on 2 shared cores)
def test_resume_reaches_the_same_result(ws, straight):
    out = str(ws.root / "runs" / "resumed")
    first = train(load_config(TrainRunConfig, None, {**SMALL, "output_dir": out, "optim.epochs": 1}), ws)
    assert len(first.history) == 2
    resumed = train(load_config(TrainRunConfig, None, {**SMALL, "output_dir": out, "resume": True}), ws)
    assert resumed.mlflow_run_id == first.mlflow_run_id  # the same MLflow run continues
    for a, b in zip(straight.history, resumed.history, strict=True):
        assert a["valid_ne"] == pytest.approx(b["valid_ne"], rel=1e-5, abs=1e-7)
    assert resumed.metrics["test_ne"] == pytest.approx(straight.metrics["test_ne"], rel=1e-5)


@pytest.mark.integration  # a real training run
def test_overfitting_run_stops_early_and_exports_its_best_epoch(ws):
    """A small train subsample at a high learning rate: the validation NE falls, then rises; the run stops
    ``optim.patience`` epochs after its best one and ``model.pt`` is that epoch's state."""
    overfit = {**SMALL, "optim.epochs": 10, "optim.patience": 2, "optim.lr": 1e-2, "optim.max_train_examples": 96,
               "tracking.enabled": "false", "output_dir": str(ws.root / "runs" / "overfit")}  # fmt: skip
    result = train(load_config(TrainRunConfig, None, overfit), ws)
    ne = [h["valid_ne"] for h in result.history]
    best = ne.index(min(ne))
    assert 0 < best < len(ne) - 1, ne  # it learned, then overfitted
    assert len(ne) - 1 == best + 2 < 10, ne  # patience 2 ended it early
    assert result.best_epoch == best
    assert result.metrics["valid_ne"] == pytest.approx(ne[best], rel=1e-6)  # scored from model.pt
    assert abs(result.metrics["valid_ne"] - ne[-1]) > 1e-3


@pytest.mark.integration  # real training runs and MLflow (~20 s each on 2 shared cores)
def test_mlflow_run_has_metrics_params_and_artifacts(ws, straight):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{ws.mlflow / 'mlflow.db'}")
    run = client.get_run(straight.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["user_model.d_model"] == "16"
    assert {"valid_ne", "valid_auc", "valid_calibration", "train_loss", "final_test_ne"} <= set(
        run.data.metrics
    )
    assert len(client.get_metric_history(run.info.run_id, "valid_ne")) == 3  # untrained + 2 epochs
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"learning_curve.png", "calibration.png", "config.yaml", "metrics.json"} <= artifacts


@pytest.mark.integration  # real training runs and MLflow (~20 s each on 2 shared cores)
def test_ranker_trains_on_user_model_tokens_via_cli(ws, straight):
    runner = CliRunner()
    sets = [
        f"{k}={v}"
        for k, v in {**SMALL, "optim.epochs": 1, "ranker.user_model": str(straight.run_dir)}.items()
    ]
    args = ["train", "--model", "ranker", "--workspace", str(ws.root)]
    for s in [*sets, f"output_dir={ws.root / 'runs' / 'ranker'}", "tracking.enabled=false"]:
        args += ["--set", s]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output[result.output.index("{") :])
    assert metrics["valid_ne"] > 0 and "test_auc" in metrics
    evaluated = runner.invoke(
        app,
        [
            "evaluate",
            "--run",
            str(ws.root / "runs" / "ranker"),
            "--training-set",
            "fx",
            "--workspace",
            str(ws.root),
        ],
    )
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads(evaluated.output[evaluated.output.index("{") :])["test_ne"] == pytest.approx(
        metrics["test_ne"]
    )
    daily = runner.invoke(app, ["evaluate", "--run", str(ws.root / "runs" / "ranker"), "--training-set", "fx",
                                "--fresh-as-of", "day", "--workspace", str(ws.root)])  # fmt: skip
    assert daily.exit_code == 0, daily.output  # a store written once a day serves other (older) fresh events
    assert json.loads(daily.output[daily.output.index("{") :])["test_ne"] != pytest.approx(metrics["test_ne"])


def test_bad_input_is_a_clear_error(ws):
    runner = CliRunner()
    result = runner.invoke(
        app, ["train", "--model", "user", "--training-set", "nope", "--workspace", str(ws.root)]
    )
    assert result.exit_code == 2 and "not a training set" in result.output
    result = runner.invoke(
        app, ["train", "--model", "bert", "--training-set", "fx", "--workspace", str(ws.root)]
    )
    assert result.exit_code == 2 and "model must be 'user', 'ranker' or 'sasrec'" in result.output
    result = runner.invoke(
        app,
        [
            "train",
            "--model",
            "ranker",
            "--training-set",
            "fx",
            "--workspace",
            str(ws.root),
            "--set",
            "tracking.enabled=false",
        ],
    )
    assert result.exit_code == 2 and "no user_embedding values" in result.output


def _tiny_user_bundle(**kw):
    from models.architectures.user_model import UserModel
    from models.inference.bundle import ModelBundle
    from tests.models.fixtures import tiny_dense, tiny_set, tiny_user_config

    torch.manual_seed(0)
    cfg = tiny_user_config(**kw)
    model = UserModel(cfg, tiny_set().vocab, len(tiny_dense().columns)).eval()
    return ModelBundle("user", model, tiny_set().vocab, tiny_dense(), 0, "v", "")


def test_daily_snapshot_tokens_are_the_history_as_of_the_day_start():
    import numpy as np

    from models.training.prepare import user_tokens_per_example
    from tests.models.fixtures import tiny_set

    data, bundle = tiny_set(), _tiny_user_bundle(snapshot="day")
    tokens = user_tokens_per_example(bundle, data)
    rows = np.arange(len(data.examples))
    group, cuts = data.snapshot_groups(rows)
    assert tokens.shape == (len(rows), 2 * 16)
    for g in np.unique(group)[:5]:  # every impression of a user-day reads the same cached tokens
        same = tokens[group == g]
        np.testing.assert_array_equal(same, np.broadcast_to(same[0], same.shape))
    pick = np.array([0, 7, 50, len(rows) - 1])
    cfg = bundle.cfg
    history = data.history(pick, cfg.max_history, cfg.time_buckets, gap_to="previous", cuts=cuts[pick])
    user_id = torch.as_tensor(data.examples["user_id"].to_numpy()[pick])
    with torch.no_grad():
        direct = bundle.model.encode_user(history, user_id).flatten(1).numpy()
    np.testing.assert_allclose(tokens[pick], direct, rtol=1e-5, atol=1e-6)


def test_without_snapshots_tokens_are_per_example():
    import numpy as np

    from models.inference.bundle import embed_examples
    from models.training.prepare import user_tokens_per_example
    from tests.models.fixtures import tiny_set

    bundle = _tiny_user_bundle()
    np.testing.assert_array_equal(
        user_tokens_per_example(bundle, tiny_set()), embed_examples(bundle, tiny_set())
    )


def test_snapshot_setting_is_validated(ws):
    with pytest.raises(ValueError, match="user_model.snapshot must be 'example' or 'day'"):
        train(load_config(TrainRunConfig, None, {**SMALL, "user_model.snapshot": "week"}), ws)
