"""The shared training loop on DeepSpeed ranks: early stopping and the export of the best state.

A planted overfitting run (a small train subsample, a high learning rate, many epochs): the validation NE falls,
then rises. On 1 and on 2 ranks the run stops ``optim.patience`` evaluations after its best one, well inside the
epoch budget, and ``model.pt`` scores the best evaluation's NE, not the last one's; both world sizes walk the same
steps, so they pick the same best step and stop at the same step. Rank 0 writes the plots a one-process run writes
(learning curve, calibration); the 2-rank run (what the train DAG launches) tracks to the workspace's MLflow store
and logs them as artifacts of its run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.tracking.training_run import recorded_run_id
from models.training.evaluate import load_for_evaluation
from models.training.train import evaluate_rows
from tests.models.distributed.conftest import gemflow_train, write_learnable_set

pytestmark = pytest.mark.integration

EPOCHS = 10
OVERFIT = {
    "user_model.d_model": 32,
    "user_model.max_history": 32,
    "user_model.next_event_weight": 0,  # its sampled negatives differ by world size: same runs on 1 and 2 ranks
    "optim.max_train_examples": 96,
    "optim.epochs": EPOCHS,
    "optim.patience": 2,
    "optim.lr": 1e-2,
    "distributed.precision": "fp32",  # 1 and 2 ranks then differ by summation order only
    "distributed.tokens_per_step": 600,
    "distributed.checkpoint.every_steps": 0,  # only the best state and the end
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("overfit-ws")
    write_learnable_set(root / "training" / "learnable", num_users=100)
    for nproc in (1, 2):
        tracked = {"tracking.enabled": "true"} if nproc == 2 else {}
        gemflow_train(root, f"overfit-{nproc}", nproc, {**OVERFIT, **tracked})
    return {nproc: root / f"overfit-{nproc}" for nproc in (1, 2)}


def _read(run: Path, name: str):
    return json.loads((run / name).read_text())


@pytest.mark.parametrize("nproc", [1, 2])
def test_overfitting_run_stops_early_and_exports_its_best_step(runs, nproc):
    run = runs[nproc]
    metrics, history = _read(run, "metrics.json"), _read(run, "history.json")
    ne = [h["valid_ne"] for h in history]
    best = min(range(len(ne)), key=ne.__getitem__)
    assert 0 < best < len(ne) - 1, ne  # it learned, then overfitted
    assert len(ne) - 1 == best + 2 and history[-1]["epoch"] < EPOCHS, ne  # patience 2 ended it early
    assert metrics["best_step"] == history[best]["step"] and metrics["steps"] == history[-1]["step"]
    assert metrics["valid_ne"] == pytest.approx(ne[best], rel=1e-9)  # the engine scored the best state again

    bundle, data, builder = load_for_evaluation(run, run.parent / "training" / "learnable")
    exported = evaluate_rows(bundle.model, builder, data.split_rows("valid"), 1024, "valid_")["valid_ne"]
    assert exported == pytest.approx(ne[best], rel=1e-4)  # model.pt is the best state ...
    assert abs(exported - ne[-1]) > 100 * abs(exported - ne[best])  # ... not the last one


def test_one_and_two_ranks_stop_at_the_same_step(runs):
    one, two = (_read(runs[n], "history.json") for n in (1, 2))
    assert [(h["epoch"], h["step"]) for h in one] == [(h["epoch"], h["step"]) for h in two]
    assert _read(runs[1], "metrics.json")["best_step"] == _read(runs[2], "metrics.json")["best_step"]
    for a, b in zip(one, two, strict=True):  # the same training, up to summation order
        assert a["valid_ne"] == pytest.approx(b["valid_ne"], rel=1e-3)


PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("nproc", [1, 2])
def test_rank_0_writes_the_learning_curve_and_calibration_plots(runs, nproc):
    run = runs[nproc]
    for name in ("learning_curve.png", "calibration.png"):
        assert (run / name).read_bytes().startswith(PNG), name
    history = _read(run, "history.json")
    # the curve's gray train line: each evaluation after the first holds the mean train loss since the one before
    assert "train_loss" not in history[0] and all(h["train_loss"] > 0 for h in history[1:]), history


def test_the_two_rank_run_logs_its_plots_to_mlflow(runs):
    from mlflow import MlflowClient

    from gemflow.workspace import Workspace
    from models.tracking.mlflow_store import embedded_uri

    run = runs[2]
    client = MlflowClient(tracking_uri=embedded_uri(Workspace(run.parent)))
    run_id = recorded_run_id(run)
    logged = {a.path: a.file_size for a in client.list_artifacts(run_id)}
    for name in ("learning_curve.png", "calibration.png", "metrics.json", "history.json"):
        assert logged.get(name), f"{name} not logged to run {run_id}: {sorted(logged)}"
    assert logged["learning_curve.png"] == (run / "learning_curve.png").stat().st_size
    assert client.get_run(run_id).info.status == "FINISHED"
    assert not (runs[1] / "mlflow_run.json").exists()  # the 1-rank run tracked nothing
