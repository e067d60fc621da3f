"""distributed.precision=auto: bf16 only where it multiplies at least as fast as fp32; a resume keeps its own."""

from __future__ import annotations

import json
import math

import pytest

from gemflow.config import load_config
from models.config import TrainRunConfig
from models.training.distributed import precision
from models.training.distributed.checkpoint import LATEST, checkpoint_name
from models.training.distributed.launch import run_precision
from models.training.distributed.run_checkpoint import check_precision


def test_bf16_is_chosen_only_when_it_is_not_slower():
    assert precision.choose(bf16_gflops=120.0, fp32_gflops=60.0) == "bf16"
    assert precision.choose(bf16_gflops=60.0, fp32_gflops=60.0) == "bf16"
    assert precision.choose(bf16_gflops=5.4, fp32_gflops=55.0) == "fp32"  # AVX2 only: bf16 in software


def test_a_set_precision_is_kept_without_measuring(monkeypatch):
    monkeypatch.setattr(precision, "linear_gflops", lambda *a, **k: pytest.fail("measured a set precision"))
    assert precision.resolve("bf16") == ("bf16", {})
    assert precision.resolve("fp32") == ("fp32", {})


def test_auto_measures_both_dtypes_on_this_machine_and_takes_the_faster():
    chosen, rates = precision.resolve("auto", "cpu")
    assert set(rates) == {"bf16", "fp32"}
    assert all(math.isfinite(r) and r > 0 for r in rates.values()), rates
    assert chosen == precision.choose(rates["bf16"], rates["fp32"])


def _cfg(**overrides) -> TrainRunConfig:
    return load_config(TrainRunConfig, None, {"distributed.precision": "auto", **overrides})


def _checkpoint(run_dir, saved: dict) -> None:
    root = run_dir / "checkpoints"
    (root / checkpoint_name(8)).mkdir(parents=True)
    (root / checkpoint_name(8) / "state.json").write_text(json.dumps(saved))
    (root / LATEST).write_text(checkpoint_name(8))


def test_a_resume_continues_in_its_checkpoints_precision(tmp_path, monkeypatch):
    _checkpoint(tmp_path, {"step": 8, "precision": "fp32"})
    # what this machine would choose now
    monkeypatch.setattr(precision, "resolve", lambda *a, **k: ("bf16", {}))
    assert run_precision(_cfg(resume="true"), tmp_path) == "fp32"
    assert run_precision(_cfg(resume="false"), tmp_path) == "bf16"  # a fresh start measures
    assert run_precision(_cfg(resume="true"), tmp_path / "new-run") == "bf16"  # nothing to resume


def test_a_checkpoint_from_before_the_precision_was_recorded_measures(tmp_path, monkeypatch):
    _checkpoint(tmp_path, {"step": 8})
    monkeypatch.setattr(precision, "resolve", lambda *a, **k: ("fp32", {}))
    assert run_precision(_cfg(resume="true"), tmp_path) == "fp32"


def test_resuming_in_another_precision_is_a_clear_error(tmp_path):
    check_precision("bf16", "bf16", tmp_path)
    check_precision("", "fp32", tmp_path)  # written before the precision was recorded: nothing to compare
    with pytest.raises(ValueError, match=r"written by a bf16 run but this run is fp32.*precision=bf16"):
        check_precision("bf16", "fp32", tmp_path)
