"""Dense candidate features and their normalization: log1p of magnitudes, then train-split z-scores.

``DenseSpec`` is fitted on a training set's train split, saved with the model, and applied alike in training
and serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pandas as pd

from models.training.data import TrainingSetError

log = logging.getLogger(__name__)


@dataclass
class DenseSpec:
    """Dense feature columns and their normalization (log1p of magnitudes, then train-split z-scores)."""

    columns: list[str]
    mean: list[float]
    std: list[float]

    def apply(self, frame: pd.DataFrame) -> np.ndarray:
        if not self.columns:
            return np.zeros((len(frame), 0), np.float32)
        missing = [c for c in self.columns if c not in frame]
        if missing:
            raise TrainingSetError(f"dense feature column(s) {missing} are missing from the training set")
        x = _squash(frame[self.columns].to_numpy(np.float64))
        return ((x - np.array(self.mean)) / np.array(self.std)).astype(np.float32)

    @classmethod
    def fit(cls, frame: pd.DataFrame, columns: list[str]) -> DenseSpec:
        """Z-scores from ``frame`` (the train split). A column that is constant there (e.g. yesterday's ad
        stats on the first logged day: all missing) is left out: the model could learn nothing from it, and
        the values it takes later would move the scores through weights its training never touched."""
        x = _squash(frame[columns].to_numpy(np.float64)) if columns else np.zeros((1, 0))
        mean = np.nanmean(x, axis=0) if len(x) else np.zeros(len(columns))
        std = np.nanstd(x, axis=0) if len(x) else np.ones(len(columns))
        varies = std > 1e-6 if len(x) > 1 else np.ones(len(columns), bool)
        if not varies.all():
            dropped = [c for c, v in zip(columns, varies, strict=True) if not v]
            log.warning("dense feature(s) constant on the train split, left out: %s", ", ".join(dropped))
        keep = np.flatnonzero(varies)
        return cls([columns[i] for i in keep], np.nan_to_num(mean[keep]).tolist(), std[keep].tolist())


def _squash(x: np.ndarray) -> np.ndarray:
    return np.nan_to_num(np.sign(x) * np.log1p(np.abs(x)))
