"""Safe re-training: every invocation is a new run unless asked to resume; a resume with another model or data
config is refused, naming the keys, before anything is written (``models.training.run_folder``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gemflow.cli import app
from gemflow.config import load_config, save_config
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.training.run_folder import ResumeRefused, check_resume, choose, differences
from models.training.train import train
from tests.models.fixtures import write_training_set
from tests.models.test_train import SMALL


def _cfg(**overrides) -> TrainRunConfig:
    return load_config(TrainRunConfig, None, {**SMALL, **overrides})


def test_differences_name_model_and_data_keys_but_not_what_a_continuation_may_change():
    saved = {"user_model": {"d_model": 64}, "optim": {"epochs": 2, "max_train_examples": 0, "lr": 1e-3},
             "tracking": {"run_name": "a"}, "distributed": {"nproc": 2, "moe": {"num_experts": 4}}}  # fmt: skip
    current = {"user_model": {"d_model": 32}, "optim": {"epochs": 9, "max_train_examples": 500, "lr": 1e-3},
               "tracking": {"run_name": "b"}, "distributed": {"nproc": 4, "moe": {"num_experts": 8}}}  # fmt: skip
    assert differences(saved, current) == [
        "distributed.moe.num_experts (4 -> 8)",
        "optim.max_train_examples (0 -> 500)",
        "user_model.d_model (64 -> 32)",
    ]


def test_a_new_run_takes_the_next_free_folder_and_an_explicit_taken_folder_is_refused(tmp_path):
    ws = Workspace(tmp_path)
    first = choose(_cfg(), ws, "user-fx")
    assert first == tmp_path / "models" / "user" / "user-fx"
    save_config(_cfg(), first)
    assert choose(_cfg(), ws, "user-fx") == first.with_name("user-fx-2")
    assert choose(_cfg(resume=True), ws, "user-fx") == first  # a resume continues the named folder
    with pytest.raises(ResumeRefused, match="already holds a training run: pass --resume"):
        choose(_cfg(output_dir=str(first)), ws, "ignored")


def test_a_resume_whose_config_file_is_gone_is_refused(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(ResumeRefused, match="no config.yaml"):
        check_resume(_cfg(resume=True), tmp_path, lambda a, b: a == b)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    ws = Workspace(tmp_path_factory.mktemp("retrain-ws"))
    write_training_set(ws.training("fx"), num_users=40, num_ads=30, num_categories=5, seed=3)
    return ws


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.integration  # two real (tiny) training runs with MLflow
def test_retraining_is_a_new_run_and_a_resume_with_another_config_is_refused_before_writing(ws):
    first = train(_cfg(**{"optim.epochs": 1}), ws)
    assert first.run_dir == ws.root / "models" / "user" / "user-fx"

    # the same command again: a new run in a new folder, a new MLflow run; the first run is untouched
    before = _snapshot(first.run_dir)
    second = train(_cfg(**{"optim.epochs": 1}), ws)
    assert second.run_dir == first.run_dir.with_name("user-fx-2")
    assert second.mlflow_run_id != first.mlflow_run_id
    assert _snapshot(first.run_dir) == before

    # resuming with another width or another train subsample: refused, naming the keys; nothing written
    runner = CliRunner()
    for key, value in (("user_model.d_model", 32), ("optim.max_train_examples", 64)):
        args = ["train", "--model", "user", "--workspace", str(ws.root), "--resume"]
        for k, v in {**SMALL, "optim.epochs": 2, key: value}.items():
            args += ["--set", f"{k}={v}"]
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert f"differing key(s): {key} (" in result.output and "Traceback" not in result.output
        assert _snapshot(first.run_dir) == before

    # resuming with the run's own config and more epochs continues the same MLflow run
    resumed = train(_cfg(**{"optim.epochs": 2, "resume": True}), ws)
    assert resumed.run_dir == first.run_dir and resumed.mlflow_run_id == first.mlflow_run_id
    assert len(resumed.history) == 3  # untrained + epoch 1 (from the checkpoint) + epoch 2
