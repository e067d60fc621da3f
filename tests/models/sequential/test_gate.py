"""The registry gate judges next-item models by leave-one-out NDCG@10, exactly as training scored them."""

from __future__ import annotations

import pytest

from gemflow.config import load_config
from models.config import TrainRunConfig
from models.inference.bundle import load_bundle
from models.tracking.registry.gate import GateConfig, decide
from models.tracking.registry.heldout import bundle_metrics
from models.training.data import TrainingSet
from models.training.train import train


def _small(name: str, out, epochs: int) -> dict:
    return {
        "training_set": name, "output_dir": str(out), "tracking.enabled": False, "resume": False,
        "optim.epochs": epochs, "optim.batch_size": 64, "user_model.d_model": 16, "user_model.max_history": 16,
    }  # fmt: skip


def test_ranking_gate_decisions():
    cfg = GateConfig(min_relative_ndcg_gain=0.01)
    assert decide({"ndcg@10": 0.30}, None, cfg) == (True, "no champion yet")
    promoted, reason = decide({"ndcg@10": 0.31}, {"ndcg@10": 0.30}, cfg)
    assert promoted and "beats champion" in reason
    promoted, reason = decide({"ndcg@10": 0.302}, {"ndcg@10": 0.30}, cfg)  # +0.7% < the 1% margin
    assert not promoted and "needs >= 0.30300" in reason
    promoted, reason = decide({"ndcg@10": 0.5}, {"ne": 0.9, "calibration": 1.0}, cfg)
    assert not promoted and "not comparable" in reason
    with pytest.raises(ValueError, match="'ndcg@10'"):
        decide({"auc": 0.7}, None, cfg)


def test_the_gate_scores_a_next_item_model_as_training_did(loo_set, tmp_path):
    ws, name = loo_set
    result = train(load_config(TrainRunConfig, None, _small(name, tmp_path, epochs=2)), ws)
    judged = bundle_metrics(load_bundle(result.run_dir), TrainingSet(ws.training(name)), "test")
    assert "ne" not in judged
    for key in ("ndcg@10", "hr@10", "mrr", "full_ndcg@10"):
        assert judged[key] == pytest.approx(result.metrics[f"test_{key}"], abs=1e-6)


def test_evaluate_cli_ranks_a_next_item_model_and_the_click_head_refuses(loo_set, tmp_path):
    import json

    from typer.testing import CliRunner

    from gemflow.cli import app
    from models.training.evaluate import loo_lists, score_lists
    from models.training.prepare import prepare

    ws, name = loo_set
    overrides = _small(name, tmp_path, epochs=1)
    result = train(load_config(TrainRunConfig, None, overrides), ws)
    out = CliRunner().invoke(
        app, ["evaluate", "-r", str(result.run_dir), "-t", name, "--workspace", str(ws.root)]
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["test_ndcg@10"] == pytest.approx(result.metrics["test_ndcg@10"], abs=1e-6)
    # a click head trained on a positive-only log would tie every candidate: ranking with it is refused
    click = prepare(load_config(TrainRunConfig, None, {**overrides, "user_model.objective": "click"}), ws)
    with pytest.raises(ValueError, match="ties every candidate"):
        score_lists(click.bundle, click.data, click.builder, loo_lists(click.data, num_negatives=5))
