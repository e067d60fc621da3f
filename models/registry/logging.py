"""Log a gemflow torch model to MLflow without pickles: state dict + JSON spec + the models-from-code loader."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch

PYFUNC_CODE = Path(__file__).with_name("pyfunc_model.py")


@dataclass(frozen=True)
class LoggedModel:
    name: str
    version: str
    model_uri: str  # models:/name/version
    run_id: str


def log_torch_model(
    model: torch.nn.Module,
    *,
    registered_name: str,
    factory: str,
    predict: str,
    model_config: dict[str, Any],
    input_example: dict[str, np.ndarray],
    training_set: str | None = None,
    tags: dict[str, str] | None = None,
) -> LoggedModel:
    """Log into the active run (one is started if none is) and register a new version of ``registered_name``.

    ``factory`` / ``predict`` are ``models.<module>:<function>`` paths: ``factory(model_config) -> nn.Module``
    and ``predict(module, inputs) -> dict[str, np.ndarray]``. ``training_set`` (a path) is recorded as the run's
    input dataset so every version points at the data it learned from.
    """
    spec = {"factory": factory, "predict": predict, "model_config": model_config}
    active = mlflow.active_run()
    run = active or mlflow.start_run()
    try:
        if training_set:
            _log_training_set(training_set)
        with tempfile.TemporaryDirectory() as tmp:
            weights = Path(tmp) / "weights.pt"
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, weights)
            spec_path = Path(tmp) / "spec.json"
            spec_path.write_text(json.dumps(spec, indent=2, sort_keys=True))
            info = mlflow.pyfunc.log_model(
                name=registered_name,
                python_model=str(PYFUNC_CODE),
                artifacts={"weights": str(weights), "spec": str(spec_path)},
                input_example=input_example,
                registered_model_name=registered_name,
                tags=tags,
            )
        version = str(info.registered_model_version)
        return LoggedModel(registered_name, version, f"models:/{registered_name}/{version}", run.info.run_id)
    finally:
        if active is None:
            mlflow.end_run()


def _log_training_set(path: str) -> None:
    import pandas as pd

    manifest = Path(path) / "manifest.json"
    meta = json.loads(manifest.read_text()) if manifest.exists() else {}
    df = pd.DataFrame(
        [{"path": str(path), **{k: str(v) for k, v in meta.items() if not isinstance(v, dict)}}]
    )
    dataset = mlflow.data.from_pandas(df, source=str(path), name=Path(path).name)
    mlflow.log_input(dataset, context="training")


def load_torch_model(model_uri: str) -> torch.nn.Module:
    """The underlying nn.Module of a logged gemflow model (e.g. ``models:/gem-ranker@champion``)."""
    pyfunc = mlflow.pyfunc.load_model(model_uri)
    return pyfunc.unwrap_python_model().model
