"""MLflow tracking of a training run: config, per-step loss, per-epoch metrics, plots as artifacts.

Default backend: ``sqlite:///<ws.mlflow>/mlflow.db`` with artifacts under ``<ws.mlflow>/artifacts``; set
``tracking.tracking_uri`` to use a server instead. A resumed run continues the same MLflow run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gemflow.config import to_dict
from gemflow.workspace import Workspace
from models.config import TrackingConfig


def tracking_uri(cfg: TrackingConfig, ws: Workspace) -> str:
    if cfg.tracking_uri:
        return cfg.tracking_uri
    ws.mlflow.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{ws.mlflow / 'mlflow.db'}"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


class Tracker:
    """Thin wrapper so the training loop reads the same with tracking on or off."""

    def __init__(self, cfg: TrackingConfig, ws: Workspace, run_name: str, run_id: str | None = None):
        self.enabled = cfg.enabled
        self.run_id: str | None = None
        if not self.enabled:
            return
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri(cfg, ws))
        experiment = mlflow.get_experiment_by_name(cfg.experiment)
        if experiment is None:
            artifacts = (ws.mlflow / "artifacts").resolve()
            location = artifacts.as_uri() if not cfg.tracking_uri else None
            experiment_id = mlflow.create_experiment(cfg.experiment, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id
        run = mlflow.start_run(
            run_id=run_id, experiment_id=None if run_id else experiment_id, run_name=run_name
        )
        self.run_id = run.info.run_id

    def log_config(self, cfg: Any) -> None:
        if self.enabled:
            params = {k: str(v)[:500] for k, v in _flatten(to_dict(cfg)).items()}
            existing = self.mlflow.get_run(self.run_id).data.params
            self.mlflow.log_params({k: v for k, v in params.items() if k not in existing})

    def log_params(self, params: dict[str, Any]) -> None:
        if self.enabled:
            existing = self.mlflow.get_run(self.run_id).data.params
            self.mlflow.log_params({k: str(v) for k, v in params.items() if k not in existing})

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.enabled:
            self.mlflow.set_tags(tags)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.enabled:
            finite = {
                k: float(v) for k, v in metrics.items() if v == v
            }  # NaN (e.g. AUC of one class) is skipped
            self.mlflow.log_metrics(finite, step=step)

    def log_artifact(self, path: Path) -> None:
        if self.enabled:
            self.mlflow.log_artifact(str(path))

    def end(self, status: str = "FINISHED") -> None:
        if self.enabled:
            self.mlflow.end_run(status=status)
