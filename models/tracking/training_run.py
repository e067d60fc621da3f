"""MLflow tracking of a training run: config, per-step loss, per-epoch metrics, plots as artifacts.

The store is the workspace's (``models.tracking.mlflow_store``): ``sqlite:///<ws.mlflow>/mlflow.db`` with artifacts under
``<ws.mlflow>/artifacts``, or ``tracking.tracking_uri`` / ``$MLFLOW_TRACKING_URI`` for a server. A resumed run
continues the same MLflow run. The run folder records the run's id (``mlflow_run.json``) so that registration
logs the model into this very run (``models.tracking.registry``): the registered version's source run is the training run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gemflow.config import to_dict
from gemflow.workspace import Workspace
from models.config import TrackingConfig
from models.tracking import mlflow_store

RUN_RECORD = "mlflow_run.json"
RUN_DIR_TAG = "gemflow.run_dir"  # the run folder, relative to the workspace root when inside it
BEST_STEP_TAG = "gemflow.best_step"  # the step the best evaluation was logged at: the logged model's metrics


class RunRecordError(ValueError):
    pass


def tracking_uri(cfg: TrackingConfig, ws: Workspace) -> str:
    return mlflow_store.resolve(ws, cfg.tracking_uri).tracking_uri


def recorded_run_id(run_dir: Path) -> str:
    """The MLflow run a run folder was trained in (written by ``Tracker.record``)."""
    path = run_dir / RUN_RECORD
    if not path.exists():
        raise RunRecordError(
            f"{run_dir} records no MLflow run ({RUN_RECORD} is missing): it was trained with tracking off "
            "or by an older version; retrain it with tracking on to register it"
        )
    try:
        return str(json.loads(path.read_text())["run_id"])
    except (ValueError, KeyError, TypeError) as err:
        raise RunRecordError(f"{path} is not a run record ({{'run_id': ...}}): {err}") from err


def run_dir_of(run, ws: Workspace) -> Path:
    """The run folder an MLflow training run recorded (its ``gemflow.run_dir`` tag), in the workspace ``ws``."""
    value = run.data.tags.get(RUN_DIR_TAG)
    if not value:
        raise RunRecordError(f"MLflow run {run.info.run_id} names no run folder (tag {RUN_DIR_TAG})")
    return ws.root / value if not Path(value).is_absolute() else Path(value)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def training_dataset(data):
    """The MLflow dataset of a training set (``models.training.data.TrainingSet``): a sample of its examples with the manifest,
    sourced at its folder. Training logs it as the run's input; registration logs the same one (same digest)."""
    import mlflow

    manifest = {k: v for k, v in data.manifest.items() if not isinstance(v, dict | list)}
    frame = data.examples[["example_id", "user_id", "ad_id", "ts", "click", "conversion", "split"]]
    frame = frame.assign(manifest=json.dumps(manifest, sort_keys=True)).head(1000)  # a sample, not the data
    return mlflow.data.from_pandas(frame, source=str(data.path), name=data.path.name, targets="click")


class Tracker:
    """Thin wrapper so the training loop reads the same with tracking on or off."""

    def __init__(self, cfg: TrackingConfig, ws: Workspace, run_name: str, run_id: str | None = None):
        self.enabled = cfg.enabled
        self.run_id: str | None = None
        if not self.enabled:
            return
        import mlflow

        self.mlflow, self.ws = mlflow, ws
        store = mlflow_store.use(ws, cfg.tracking_uri)
        experiment_id = mlflow_store.experiment_id(mlflow.MlflowClient(), cfg.experiment, store)
        run = mlflow.start_run(
            run_id=run_id, experiment_id=None if run_id else experiment_id, run_name=run_name
        )
        self.run_id = run.info.run_id

    def record(self, run_dir: Path) -> None:
        """Write the run's id into ``run_dir`` and tag the run with the folder (both ways for registration)."""
        if not self.enabled:
            (Path(run_dir) / RUN_RECORD).unlink(missing_ok=True)  # an earlier tracked run's id would be a lie
            return
        run_dir = Path(run_dir).resolve()
        root = self.ws.root.resolve()
        where = run_dir.relative_to(root) if run_dir.is_relative_to(root) else run_dir
        self.mlflow.set_tag(RUN_DIR_TAG, str(where))
        (run_dir / RUN_RECORD).write_text(json.dumps({"run_id": self.run_id}, indent=2) + "\n")

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

    def log_training_set(self, data) -> None:
        """Log the training set as the run's input (MLflow's "Datasets used"), at the start of training."""
        if self.enabled:
            self.mlflow.log_input(training_dataset(data), context="training")

    def mark_best(self, step: int) -> None:
        """Record the step of the best evaluation: registration links that step's metrics to the logged model."""
        self.set_tags({BEST_STEP_TAG: str(int(step))})

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
