"""The end of a training run, one path for both strategies (``models.training.train``'s one process, the ranks of
``models.training.distributed.trainer``): the best state judged on the valid and test splits, ``metrics.json`` and
``history.json`` in the run folder, the plots, and what the tracker records of them.

What differs stays with each strategy: how the best state comes back (``model.pt`` reloaded / the best checkpoint
loaded into the engine) and how a split is scored (one process / every rank its share, then all-gather);
``head_metrics`` judges the scores the same way for both (and for the registry's held-out gate).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from models.training.metrics import binary_metrics


def head_metrics(labels: np.ndarray, probs: np.ndarray, prefix: str = "") -> dict[str, float]:
    """NE, AUC and calibration of the click head (column 0) and, as ``<prefix>conversion_*``, the conversion
    head (column 1)."""
    return {
        **binary_metrics(labels[:, 0], probs[:, 0], prefix),
        **binary_metrics(labels[:, 1], probs[:, 1], f"{prefix}conversion_"),
    }


def final_metrics(
    head: dict[str, float], evaluate: Callable[[str], dict[str, float]], history: list[dict], select: str
) -> dict[str, float]:
    """``head`` (where the best state is: its epoch, step), then the best state's valid and test metrics
    (``evaluate(split)``, prefixed ``<split>_``), then the untrained model's selection metric (``initial_*``)."""
    final = dict(head)
    final |= evaluate("valid")
    final |= evaluate("test")
    if history:
        final[f"initial_{select}"] = history[0][select]
    return final


def write_plots(
    run_dir: Path, history: list[dict], valid: tuple[np.ndarray, np.ndarray] | None, x: str = "epoch"
) -> list[Path]:
    """The learning curve of the run's evaluations (by ``x``: epoch or step) and, given the best state's
    (labels, probabilities) on the valid split, its click calibration."""
    from models.tracking.plots import calibration_plot, learning_curve_plot

    plots = [learning_curve_plot(history, run_dir / "learning_curve.png", x=x)] if history else []
    if valid is not None:
        labels, probs = valid
        plots.append(calibration_plot(labels[:, 0], probs[:, 0], run_dir / "calibration.png"))
    return plots


def record(
    run_dir: Path,
    final: dict[str, float],
    history: list[dict],
    tracker,
    *,
    step: int,
    best: int,
    plots: list[Path],
) -> None:
    """``metrics.json`` and ``history.json`` in the run folder; the tracker (None: none) gets the final metrics
    (``final_*``, at ``step``), the best evaluation's mark (at ``best``: evaluations are logged at their epoch or
    global step), the plots and the run's files."""
    (run_dir / "metrics.json").write_text(json.dumps(final, indent=2))
    (run_dir / "history.json").write_text(json.dumps(history, indent=2))
    if tracker is None:
        return
    tracker.log_metrics({f"final_{k}": v for k, v in final.items()}, step=step)
    tracker.mark_best(best)
    for path in (*plots, *(run_dir / n for n in ("config.yaml", "metrics.json", "history.json"))):
        if path.exists():
            tracker.log_artifact(path)
