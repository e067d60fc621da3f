"""Register a trained gemflow model in MLflow: the pickle-free bundle, a signature, an input example, the
training set as the run's input dataset, and the training config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
from mlflow.models import infer_signature

from models.data import TrainingSet
from models.inference import MODEL_FILE, load_bundle
from models.registry.flat import to_frame

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
    """Log ``run_dir/model.pt`` into the active MLflow run (one is started if none is) and register it."""
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

    active = mlflow.active_run()
    run = active or mlflow.start_run(run_name=f"register-{bundle.kind}-{run_dir.name}")
    try:
        mlflow.log_input(_dataset(data), context="training")
        for extra in ("config.yaml", "metrics.json"):
            if (run_dir / extra).exists():
                mlflow.log_artifact(str(run_dir / extra), artifact_path="training")
        info = mlflow.pyfunc.log_model(
            name=name,
            python_model=str(PYFUNC_CODE),
            artifacts={"bundle": str(run_dir / MODEL_FILE)},
            signature=signature,
            input_example=example,
            registered_model_name=name,
            tags={"gemflow.kind": bundle.kind, "gemflow.run_dir": run_dir.name},
        )
        version = str(info.registered_model_version)
        client = mlflow.MlflowClient()
        client.set_model_version_tag(name, version, "gemflow.training_set", str(training_set))
        if bundle.user_model_version:
            client.set_model_version_tag(
                name, version, "gemflow.user_model_version", bundle.user_model_version
            )
        return RegisteredVersion(name, version, run.info.run_id)
    finally:
        if active is None:
            mlflow.end_run()


def _dataset(data: TrainingSet):
    manifest = {k: v for k, v in data.manifest.items() if not isinstance(v, dict | list)}
    frame = data.examples[["example_id", "user_id", "ad_id", "ts", "click", "conversion", "split"]]
    frame = frame.assign(manifest=json.dumps(manifest, sort_keys=True)).head(1000)  # a sample, not the data
    return mlflow.data.from_pandas(frame, source=str(data.path), name=data.path.name, targets="click")


def load_registered(model_uri: str):
    """The ``ModelBundle`` behind a registered version (``models:/gem-ranker@champion``)."""
    return mlflow.pyfunc.load_model(model_uri).unwrap_python_model().bundle
