"""Training plots written as PNG artifacts (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on training machines
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def learning_curve_plot(history: list[dict[str, float]], path: Path, x: str = "epoch") -> Path:
    """Validation NE (click, conversion) and train loss per evaluation; the first is the untrained model.

    ``x`` is the history key of the horizontal axis: ``epoch`` (one process evaluates once per epoch) or ``step``
    (a distributed run may evaluate every ``distributed.eval_every`` steps, several times an epoch)."""
    curves = {"valid_ne": "valid NE (click)", "valid_conversion_ne": "valid NE (conversion)"}
    return _epoch_curves(history, curves, "normalized entropy", "learning curve", "upper right", path, x)


def _epoch_curves(
    history, curves: dict[str, str], ylabel: str, title: str, legend: str, path: Path, x: str = "epoch"
) -> Path:
    """One line per metric key of ``curves`` over the evaluations of ``history`` (by ``x``), the train loss on a
    second axis."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for (key, label), style in zip(curves.items(), ("o-", "s--"), strict=False):
        points = [h for h in history if key in h]  # a metric measured every few evaluations: joined points
        ax.plot([h[x] for h in points], [h[key] for h in points], style, label=label)
    _train_loss_axis(ax, history, x)
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    ax.legend(loc=legend)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _train_loss_axis(ax, history: list[dict[str, float]], x: str = "epoch") -> None:
    """The train loss per evaluation on a second y axis (gray): the untrained model's first entry has none."""
    trained = [h for h in history if "train_loss" in h]
    if trained:
        ax2 = ax.twinx()
        ax2.plot([h[x] for h in trained], [h["train_loss"] for h in trained], "^:", color="gray")
        ax2.set_ylabel("train loss (gray)")


def calibration_plot(labels: np.ndarray, preds: np.ndarray, path: Path, bins: int = 10) -> Path:
    """Observed rate vs mean prediction per prediction decile (the diagonal is perfect calibration)."""
    order = np.argsort(preds)
    groups = [g for g in np.array_split(order, bins) if len(g)]
    mean_pred = [preds[g].mean() for g in groups]
    observed = [labels[g].mean() for g in groups]
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    top = max([*mean_pred, *observed, 1e-3])
    ax.plot([0, top], [0, top], color="gray", lw=1)
    ax.plot(mean_pred, observed, "o-")
    ax.set_xlabel("mean predicted p(click)")
    ax.set_ylabel("observed click rate")
    ax.set_title("calibration (valid)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def ranking_curve_plot(history: list[dict[str, float]], metric: str, path: Path) -> Path:
    """The selection metric (e.g. valid NDCG@10, sampled lists, or valid full_NDCG@10) and its twin of the other
    protocol per epoch, with the train loss; epoch 0 is the untrained model."""
    sampled = metric.replace("valid_full_", "valid_", 1)
    full = sampled.replace("valid_", "valid_full_", 1)
    curves = {sampled: f"{sampled} (99 sampled)", full: f"{sampled} (all items, history masked)"}
    title = "learning curve (leave-one-out, valid)"
    return _epoch_curves(history, curves, sampled.removeprefix("valid_"), title, "lower right", path)
