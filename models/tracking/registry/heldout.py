"""The gate's judge: score a registered version on the same held-out split as every other version."""

from __future__ import annotations

from pathlib import Path

from models.inference.bundle import predict
from models.sequential.evaluate import is_next_item, next_item_metrics
from models.tracking.registry.logging import load_registered
from models.tracking.registry.scoring import batch_builder
from models.training.data import TrainingSet
from models.training.finish import head_metrics


def heldout_metrics(
    model_uri: str, data: TrainingSet, split: str = "test", batch_size: int = 1024
) -> dict[str, float]:
    return bundle_metrics(load_registered(model_uri), data, split, batch_size)


def bundle_metrics(
    bundle, data: TrainingSet, split: str = "test", batch_size: int = 1024
) -> dict[str, float]:
    """Next-item models (positive-only logs): leave-one-out ranking of ``split`` (NE is undefined without
    negatives). Every other model: NE, AUC and calibration of the click head (plus ``conversion_*``)."""
    if is_next_item(bundle):
        return next_item_metrics(bundle, data, split)
    rows = data.split_rows(split)
    if len(rows) == 0:
        raise ValueError(f"{data.path} has no {split!r} rows to judge models on")
    return head_metrics(
        data.labels(rows).numpy(), predict(bundle.model, batch_builder(bundle, data), rows, batch_size)
    )


def evaluator(training_set: Path, split: str = "test"):
    data = TrainingSet(training_set)
    return lambda uri: heldout_metrics(uri, data, split)
