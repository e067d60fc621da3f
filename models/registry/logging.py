"""Register a trained gemflow model in MLflow, inside the run that trained it.

Registration resumes the training run the run folder records (``models.tracking``), so the registered version's
source run holds the training params, learning curves and plots. The logged model is the pickle-free bundle
with a signature, an input example, the training set as the run's input dataset, and what it needs to load
anywhere: the repo packages it imports (``code_paths``) and pinned pip requirements (``models.registry.environment``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
from mlflow.exceptions import MlflowException
from mlflow.models import infer_signature

from models.data import TrainingSet
from models.inference import MODEL_FILE, load_bundle
from models.registry.environment import code_paths, pip_requirements
from models.registry.flat import to_frame
from models.tracking import recorded_run_id

PYFUNC_CODE = Path(__file__).with_name("pyfunc_model.py")
REGISTERED_NAMES = {"user": "gem-user-model", "ranker": "gem-ranker"}


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str
    run_id: str

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def register_bundle(
    run_dir: Path, training_set: Path, *, name: str | None = None, example_rows: int = 3
) -> RegisteredVersion:
    """Log ``run_dir/model.pt`` into the MLflow run it was trained in (resumed) and register it."""
    run_id = recorded_run_id(run_dir)
    bundle = load_bundle(run_dir)
    name = name or REGISTERED_NAMES[bundle.kind]
    data = TrainingSet(training_set)
    rows = data.split_rows("test")[:example_rows]
    if len(rows) == 0:
        rows = np.arange(min(example_rows, len(data.examples)))
    history = bundle.cfg.max_history if bundle.kind == "user" else bundle.cfg.recent_events
    example = to_frame(data, rows, history)

    from models.registry.pyfunc_model import GemModel

    loaded = GemModel()
    loaded.load_context(type("Ctx", (), {"artifacts": {"bundle": str(run_dir / MODEL_FILE)}})())
    signature = infer_signature(example, loaded.predict(None, example))

    with training_run(run_id) as run:
        mlflow.log_input(_dataset(data), context="training")
        info = mlflow.pyfunc.log_model(
            name=name,
            python_model=str(PYFUNC_CODE),
            artifacts={"bundle": str(run_dir / MODEL_FILE)},
            code_paths=code_paths(),
            pip_requirements=pip_requirements(),
            signature=signature,
            input_example=example,
            registered_model_name=name,
            tags={"gemflow.kind": bundle.kind, "gemflow.run_dir": run_dir.name},
        )
    version = str(info.registered_model_version)
    client = mlflow.MlflowClient()
    client.set_model_version_tag(name, version, "gemflow.training_set", str(training_set))
    if bundle.user_model_version:
        client.set_model_version_tag(name, version, "gemflow.user_model_version", bundle.user_model_version)
    return RegisteredVersion(name, version, run.info.run_id)


@contextmanager
def training_run(run_id: str) -> Iterator[mlflow.ActiveRun]:
    """The finished training run ``run_id``, resumed (or already active) while the block runs."""
    active = mlflow.active_run()
    if active is not None:
        if active.info.run_id != run_id:
            raise ValueError(f"MLflow run {active.info.run_id} is active, not the training run {run_id}")
        yield active
        return
    try:
        status = mlflow.MlflowClient().get_run(run_id).info.status
    except MlflowException as err:
        raise LookupError(
            f"training run {run_id} is not in the tracking store {mlflow.get_tracking_uri()} "
            "(register against the store it was trained in)"
        ) from err
    if status != "FINISHED":
        raise ValueError(
            f"training run {run_id} is {status}, not FINISHED: only a finished run is registered"
        )
    with mlflow.start_run(run_id=run_id) as run:  # ends FINISHED again
        yield run


def _dataset(data: TrainingSet):
    manifest = {k: v for k, v in data.manifest.items() if not isinstance(v, dict | list)}
    frame = data.examples[["example_id", "user_id", "ad_id", "ts", "click", "conversion", "split"]]
    frame = frame.assign(manifest=json.dumps(manifest, sort_keys=True)).head(1000)  # a sample, not the data
    return mlflow.data.from_pandas(frame, source=str(data.path), name=data.path.name, targets="click")


def load_registered(model_uri: str):
    """The ``ModelBundle`` behind a registered version (``models:/gem-ranker@champion``)."""
    return mlflow.pyfunc.load_model(model_uri).unwrap_python_model().bundle
