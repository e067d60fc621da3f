"""Training on a positive-only log through the one training loop: the next-item task learns the planted
transitions far beyond popularity, keeps the best validation state, and SASRec trains through the same loop."""

from __future__ import annotations

import json

import pytest

from gemflow.config import load_config
from models.config import TrainRunConfig
from models.inference.bundle import load_bundle
from models.sequential.data import SequenceSet
from models.sequential.evaluate import popularity_scorer, rank_split, sequence_negatives
from models.training.data import TrainingSet
from models.training.train import train

BASE = {
    "tracking.enabled": False,
    "resume": False,
    "optim.epochs": 6,
    "optim.batch_size": 32,
    "optim.lr": 0.005,
    "optim.patience": 6,
    "user_model.d_model": 32,
    "user_model.max_history": 16,
    "sasrec.d_model": 32,
    "sasrec.max_len": 16,
    "sasrec.dropout": 0.2,
    "next_item.eval_negatives": 20,
}


def _train(ws, name, tmp_path, **overrides):
    cfg = load_config(
        TrainRunConfig, None, {**BASE, "training_set": name, "output_dir": str(tmp_path), **overrides}
    )
    return train(cfg, ws)


def _popularity(ws, name) -> dict:
    seqs = SequenceSet(TrainingSet(ws.training(name)), 1, 0)
    return rank_split(popularity_scorer(seqs), seqs, "test", sequence_negatives(seqs, 20, 0), prefix="test_")


def test_user_model_learns_next_items_and_exports_its_best_epoch(loo_set, tmp_path):
    ws, name = loo_set
    result = _train(ws, name, tmp_path)
    bundle = load_bundle(result.run_dir)
    assert bundle.cfg.objective == "next_item" and bundle.cfg.item_attributes == "all"
    assert bundle.items is not None  # the attribute table travels with the model
    history = result.history
    best = max(range(len(history)), key=lambda i: history[i]["valid_ndcg@10"])
    assert result.best_epoch == history[best]["epoch"]
    metrics = json.loads((result.run_dir / "metrics.json").read_text())
    assert metrics["valid_ndcg@10"] == pytest.approx(history[best]["valid_ndcg@10"])
    pop = _popularity(ws, name)
    # next item = the next of the theme 90% of the time; items are about equally popular
    assert metrics["test_hr@10"] > 0.8 > pop["test_hr@10"] + 0.3
    assert metrics["test_full_hr@10"] > 0.5 > pop["test_full_hr@10"] + 0.3
    assert (result.run_dir / "learning_curve.png").exists()


@pytest.mark.parametrize(
    "loss",
    [
        {"next_item.loss": "bce"},
        {"next_item.loss": "full"},
        {"next_item.loss": "sampled", "next_item.num_negatives": 8, "next_item.shared_negatives": False},
    ],
    ids=["bce", "full", "sampled-per-position"],
)
def test_sasrec_trains_through_the_same_loop(loo_set, tmp_path, loss):
    ws, name = loo_set
    result = _train(ws, name, tmp_path, model="sasrec", **loss)
    assert load_bundle(result.run_dir).kind == "sasrec"
    assert result.metrics["test_hr@10"] > _popularity(ws, name)["test_hr@10"] + 0.2


def test_validation_ranks_the_full_catalog_every_nth_epoch_and_the_final_judgement_always(loo_set, tmp_path):
    ws, name = loo_set
    result = _train(
        ws, name, tmp_path, model="sasrec", **{"optim.epochs": 4, "next_item.full_ranking_every": 2}
    )
    assert [("valid_full_hr@10" in h) for h in result.history] == [True, False, True, False, True]
    assert all("valid_ndcg@10" in h for h in result.history)  # early stopping reads it at every epoch
    assert {"valid_full_ndcg@10", "test_full_ndcg@10", "test_full_unmasked_hr@10"} <= set(result.metrics)
    with pytest.raises(ValueError, match="full_ranking_every"):
        _train(ws, name, tmp_path / "bad", **{"next_item.full_ranking_every": -1})


def test_a_full_ranking_selection_metric_ranks_the_catalog_at_every_epoch_and_picks_the_best_state(
    loo_set, tmp_path
):
    ws, name = loo_set
    over = {"optim.epochs": 3, "next_item.full_ranking_every": 0, "next_item.select_metric": "full_hr@10"}
    result = _train(ws, name, tmp_path, model="sasrec", **over)
    assert all("valid_full_hr@10" in h for h in result.history)
    best = max(result.history, key=lambda h: h["valid_full_hr@10"])  # the first of equals is kept
    assert result.best_epoch == best["epoch"]
    assert result.metrics["valid_full_hr@10"] == pytest.approx(best["valid_full_hr@10"])
    assert (result.run_dir / "learning_curve.png").exists()
    with pytest.raises(ValueError, match="select_metric"):
        _train(ws, name, tmp_path / "bad", **{"next_item.select_metric": "full_auc"})


def test_the_objective_follows_the_split_and_multi_process_training_says_why_not(loo_set, tmp_path):
    from models.sequential.task import NextItemTask
    from models.training.prepare import prepare
    from models.training.train import ClickTask, make_task

    ws, name = loo_set
    cfg = load_config(TrainRunConfig, None, {**BASE, "training_set": name, "output_dir": str(tmp_path)})
    assert isinstance(make_task(cfg, ws), NextItemTask)  # auto: a leave-one-out set asks for the next item
    click = load_config(TrainRunConfig, None, {**BASE, "training_set": name, "user_model.objective": "click"})
    assert isinstance(make_task(click, ws), ClickTask)
    with pytest.raises(ValueError, match="trains in one process"):
        prepare(cfg, ws)  # what the DeepSpeed trainer builds on


def test_a_time_split_set_re_split_leave_one_out_trains_for_the_next_item(tmp_path):
    """``split_mode: leave_one_out`` re-splits a labelled time-split set per user (its last positives): "auto"
    then means the next-item objective, as on a set built leave-one-out."""
    from models.training.prepare import resolve_objective

    (tmp_path / "manifest.json").write_text(json.dumps({"split": "time"}))
    assert resolve_objective(load_config(TrainRunConfig, None, {}), tmp_path) == "click"
    resplit = load_config(TrainRunConfig, None, {"split_mode": "leave_one_out"})
    assert resolve_objective(resplit, tmp_path) == "next_item"


def test_a_second_selection_metric_keeps_its_own_best_state_judged_like_the_first(loo_set, tmp_path):
    ws, name = loo_set
    over = {
        "optim.epochs": 4,
        "next_item.select_metric": "full_ndcg@10",
        "next_item.also_select_metric": "hr@1",
    }
    result = _train(ws, name, tmp_path, model="sasrec", **over)
    assert (result.run_dir / "model-also.pt").exists()
    best = max(result.history, key=lambda h: h["valid_hr@1"])  # the first of equals is kept
    metrics = result.metrics
    assert metrics["also_best_epoch"] == best["epoch"]
    assert metrics["also_valid_hr@1"] == pytest.approx(best["valid_hr@1"])  # that very state, scored again
    assert {"also_test_hr@10", "also_test_full_ndcg@10"} <= set(metrics)
    assert metrics["best_epoch"] == max(result.history, key=lambda h: h["valid_full_ndcg@10"])["epoch"]
    for bad, match in (("full_ndcg@10", "must differ"), ("auc", "also_select_metric must be")):
        with pytest.raises(ValueError, match=match):
            _train(ws, name, tmp_path / bad, **{**over, "next_item.also_select_metric": bad})
