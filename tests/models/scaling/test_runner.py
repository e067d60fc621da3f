"""A tiny sweep end to end: real training, MLflow parent + child runs, result JSONs, resume, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from features.schema import ACTION_ID
from gemflow.cli import app
from gemflow.config import save_config
from models.scaling.composition import filter_actions
from models.scaling.config import ScalingConfig, Shape
from models.scaling.runner import Sweep, run_sweep
from tests.models.fixtures import write_training_set


def tiny_config(**kw) -> ScalingConfig:
    cfg = ScalingConfig(preset="test", training_set="fx", axes_enabled=["width"], experiments=[], workers=1)
    cfg.axes.width = [8, 16]
    cfg.base.user_model.d_model, cfg.base.user_model.num_layers = 8, 1
    cfg.base.user_model.num_heads, cfg.base.user_model.num_user_tokens = 2, 2
    cfg.base.user_model.max_history = 16
    cfg.base.optim.epochs, cfg.base.optim.batch_size, cfg.base.optim.patience = 1, 64, 1
    cfg.base.tracking.experiment = "scaling-test"
    cfg.flop_batch = 32
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture
def ws(workspace):
    write_training_set(workspace.training("fx"), num_users=30, num_ads=40, num_categories=6, seed=5)
    return workspace


def _child_runs(ws, parent_id):
    import mlflow

    from models.tracking.mlflow_store import use

    use(ws)  # not mlflow.set_tracking_uri: it exports the URI, which later tests' workspaces would inherit
    return mlflow.search_runs(
        experiment_names=["scaling-test"], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'"
    )


def test_sweep_tracks_children_and_a_rerun_skips_finished_points(ws):
    cfg = tiny_config()
    cfg.axes.width = [8, 16, 32]
    first = run_sweep(cfg, ws, progress=False)
    assert len(first.results) == 3
    parent = json.loads((first.sweep_dir / "sweep.json").read_text())["parent_run_id"]
    children = _child_runs(ws, parent)
    assert len(children) == 3
    for r in first.results.values():
        assert r["flops_per_example"] > 0 and r["examples_seen"] > 0
        assert r["compute_flops"] == pytest.approx(r["flops_per_example"] * r["examples_seen"])
        assert 0 < r["test_ne"] < 2 and r["wall_time_s"] > 0
    by_width = sorted(first.results.values(), key=lambda r: r["config"]["user_model"]["d_model"])
    assert [r["compute_flops"] for r in by_width] == sorted(r["compute_flops"] for r in by_width)
    fit = first.summary["axes"]["width"]
    assert fit["n"] == 3 and "r2" in fit and (first.sweep_dir / "summary.md").exists()
    assert any(p.name.endswith("-axes.png") for p in first.plots)

    stamps = {k: (first.sweep_dir / "points" / k / "result.json").stat().st_mtime_ns for k in first.results}
    cfg.axes.width = [8, 16, 32, 64]  # one new point; the three finished ones must not train again
    second = run_sweep(cfg, ws, progress=False)
    assert len(second.results) == 4
    for k, stamp in stamps.items():
        assert (second.sweep_dir / "points" / k / "result.json").stat().st_mtime_ns == stamp
        assert second.results[k]["mlflow_run_id"] == first.results[k]["mlflow_run_id"]
    assert len(_child_runs(ws, parent)) == 4  # same parent run, one more child
    calls = json.loads((second.sweep_dir / "sweep.json").read_text())["invocations"]
    assert [c["trained_points"] for c in calls] == [3, 1] and all(c["cpu_s"] > 0 for c in calls)
    assert second.summary["invocations"]["count"] == 2 and "All 2 invocations" in second.markdown


def test_unknown_axis_and_missing_training_set_are_named(ws):
    with pytest.raises(ValueError, match="unknown axis"):
        Sweep(tiny_config(axes_enabled=["breadth"]), ws)
    with pytest.raises(ValueError, match="not found"):
        Sweep(tiny_config(training_set="nope"), ws)


def test_filtered_history_keeps_every_example_and_only_wanted_actions(ws, tmp_path):
    src = ws.training("fx")
    dst = filter_actions(src, tmp_path / "imp", ("impression",))
    ex_src, ex_dst = pd.read_parquet(src / "examples.parquet"), pd.read_parquet(dst / "examples.parquet")
    assert len(ex_src) == len(ex_dst) and (ex_dst["cut"] <= ex_src["cut"]).all()
    seq_src, seq_dst = pq.read_table(src / "sequences.parquet"), pq.read_table(dst / "sequences.parquet")
    actions = np.concatenate(seq_dst.column("action").to_pylist())
    assert set(actions.tolist()) == {ACTION_ID["impression"]}
    # an example sees exactly the impressions that came before its original cut
    src_actions = seq_src.column("action").to_pylist()
    for row in ex_src.sample(20, random_state=0).itertuples():
        before = src_actions[row.user_row][: row.cut]
        new_cut = ex_dst.loc[ex_dst["example_id"] == row.example_id, "cut"].item()
        assert new_cut == sum(a == ACTION_ID["impression"] for a in before)
    ranker = pd.read_parquet(dst / "ranker.parquet")
    assert np.array_equal(ranker["cut"].to_numpy(), ex_dst["cut"].to_numpy())


def test_cli_runs_a_two_point_sweep(ws, tmp_path):
    cfg_path = save_config(tiny_config(), tmp_path, "scaling.yaml")
    docs = tmp_path / "docs"
    result = CliRunner().invoke(
        app,
        ["scaling", "--config", str(cfg_path), "--axes", "width", "--experiments", "", "--workers", "1",
         "--training-set", "fx", "--docs-dir", str(docs), "--no-progress", "-w", str(ws.root)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "| axis width | 2 |" in result.output
    assert (docs / "scaling.md").read_text().count("<!-- scaling:test-fx:begin -->") == 1
    assert (docs / "img" / "scaling-test-fx-axes.png").exists()
    bad = CliRunner().invoke(
        app, ["scaling", "--config", str(cfg_path), "--axes", "breadth", "-w", str(ws.root)]
    )
    assert bad.exit_code == 2 and "unknown axis" in bad.output


def test_tunability_and_composition_points_are_planned(ws):
    cfg = tiny_config(experiments=["composition", "tunability"])
    cfg.composition.seq_lens = [16]
    cfg.tunability.user_small = Shape(1, 8, 16)
    sweep = Sweep(cfg, ws)
    sweep.plan()
    groups = {g for p in sweep.grid.points.values() for g in p.groups}
    assert {"composition:diverse-16", "composition:homogeneous-16", "tunability:grow-user"} <= groups
    rankers = [p for p in sweep.grid.points.values() if p.model == "ranker"]
    assert len(rankers) == 3 and all(p.user_point is not None for p in rankers)
    # the base shape at history 16 is shared by the width axis, composition and the small user model
    shared = [p for p in sweep.grid.points.values() if {"axis:width", "composition:diverse-16"} <= p.groups]
    assert len(shared) == 1
