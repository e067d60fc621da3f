"""Register a trained gemflow model in MLflow, inside the run that trained it.

Registration resumes the training run the run folder records (``models.tracking.training_run``), so the registered version's
source run holds the training params, learning curves and plots. The logged model is the pickle-free bundle
with a signature, an input example, the training set as the run's input dataset, and what it needs to load
anywhere: the repo packages it imports (``code_paths``) and pinned pip requirements (``models.tracking.registry.environment``).

Registration is safe to retry: an attempt that died after MLflow created the version (a killed tracking server or
pod, a timeout) left a READY version whose source run is this training run and whose logged model carries the
bundle's hash; the retry finds it (``existing_version``) and reuses it instead of registering a second version.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
from mlflow.entities import LoggedModelOutput, Metric
from mlflow.exceptions import MlflowException
from mlflow.models import infer_signature

from models.inference.bundle import MODEL_FILE, load_bundle
from models.tracking import mlflow_store
from models.tracking.registry.environment import code_paths, pip_requirements
from models.tracking.registry.flat import to_frame
from models.tracking.registry.gate import logged_model_id
from models.tracking.training_run import BEST_STEP_TAG, recorded_run_id, training_dataset
from models.training.data import TrainingSet

log = logging.getLogger(__name__)

PYFUNC_CODE = Path(__file__).with_name("pyfunc_model.py")
REGISTERED_NAMES = {"user": "gem-user-model", "ranker": "gem-ranker"}
BUNDLE_HASH_TAG = "gemflow.bundle_sha256"  # on the logged model: which model.pt a version was logged from


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
    """Log ``run_dir/model.pt`` into the MLflow run it was trained in (resumed) and register it; a version an
    earlier attempt already registered from this run and bundle is reused (see ``existing_version``)."""
    run_id = recorded_run_id(run_dir)
    bundle = load_bundle(run_dir)
    name = name or REGISTERED_NAMES[bundle.kind]
    digest = bundle_hash(run_dir / MODEL_FILE)
    client = mlflow.MlflowClient()
    found = existing_version(client, name, run_id, digest)
    if found is not None:
        log.info("%s v%s is already registered from training run %s (an earlier attempt): reusing it, "
                 "not logging the model again", name, found.version, run_id)  # fmt: skip
        version = str(found.version)
    else:
        version = _log_and_register(run_dir, training_set, bundle, name, run_id, digest, example_rows)
    # (re)applied on reuse too: the earlier attempt may have died before it set them; setting a tag twice is harmless
    client.set_model_version_tag(name, version, "gemflow.training_set", str(training_set))
    if bundle.user_model_version:
        client.set_model_version_tag(name, version, "gemflow.user_model_version", bundle.user_model_version)
    return RegisteredVersion(name, version, run_id)


def existing_version(client: mlflow.MlflowClient, name: str, run_id: str, digest: str):
    """The READY version of ``name`` registered from the training run ``run_id`` with the bundle ``digest``, if an
    earlier attempt left one (the newest, should there be several); else None.

    A version's ``run_id`` is the source run of the logged model it was created from (MLflow 3 fills it from the
    LoggedModel's ``source_run_id``), which is the training run: ``log_model`` runs inside it. The bundle hash
    (a tag of the logged model, set when it is created, before the version exists) keeps a run folder whose
    model.pt changed since from reusing the old weights' version. A version still PENDING_REGISTRATION or
    FAILED_REGISTRATION is not reused: the retry logs and registers a new version, and the unfinished one is left
    as it is, with no alias (the gate only ever points aliases at the version registration returns).
    """
    if "'" in name:
        raise ValueError(f"registered model name {name!r} cannot contain a quote")
    versions = client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    for mv in sorted(versions, key=lambda v: int(v.version), reverse=True):
        if mv.status != "READY":
            log.warning("%s v%s from run %s is %s: not reused, registering a new version",
                        name, mv.version, run_id, mv.status)  # fmt: skip
            continue
        model_id = logged_model_id(mv)
        if model_id and client.get_logged_model(model_id).tags.get(BUNDLE_HASH_TAG) == digest:
            return mv
    return None


def bundle_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _log_and_register(run_dir, training_set, bundle, name, run_id, digest, example_rows) -> str:
    data = TrainingSet(training_set)
    rows = data.split_rows("test")[:example_rows]
    if len(rows) == 0:
        rows = np.arange(min(example_rows, len(data.examples)))
    history = bundle.cfg.max_history if bundle.kind == "user" else bundle.cfg.recent_events
    example = to_frame(data, rows, history)

    from models.tracking.registry.pyfunc_model import GemModel

    loaded = GemModel()
    loaded.load_context(type("Ctx", (), {"artifacts": {"bundle": str(run_dir / MODEL_FILE)}})())
    signature = infer_signature(example, loaded.predict(None, example))

    outside = mlflow.active_run() is None  # the usual case: the training run is resumed here
    with training_run(run_id):
        # the logged model's metrics: the run's at its best evaluation's step (not step 0's, the untrained model's)
        best_step = int(mlflow.get_run(run_id).data.tags.get(BEST_STEP_TAG, 0))
        dataset = training_dataset(data)
        mlflow.log_input(dataset, context="training")
        model = mlflow.initialize_logged_model(
            name=name,
            source_run_id=run_id,
            params={k: str(v) for k, v in mlflow.get_run(run_id).data.params.items()},
            tags={"gemflow.kind": bundle.kind, "gemflow.run_dir": run_dir.name, BUNDLE_HASH_TAG: digest},
        )
        if outside:
            link_to_run(model.model_id, run_id, best_step, dataset)
    # logged after the run is closed again: inside it, log_model would link the step's metrics once more, without
    # their dataset (MLflow refuses the same metric twice)
    info = mlflow.pyfunc.log_model(
        model_id=model.model_id,
        step=best_step,
        name=name,
        python_model=str(PYFUNC_CODE),
        artifacts={"bundle": str(run_dir / MODEL_FILE)},
        code_paths=code_paths(),
        pip_requirements=pip_requirements(),
        signature=signature,
        input_example=example,
        registered_model_name=name,
    )
    return str(info.registered_model_version)


def link_to_run(model_id: str, run_id: str, step: int, dataset) -> None:
    """What ``log_model`` inside the run does (the run's output at ``step``, the run's metrics at ``step`` linked to
    the model), with each metric naming the training set it was measured on: the UI's "Datasets used" of a logged
    model lists its metrics' datasets, and a run's own metric history keeps none (MLflow's SQL store has no column
    for it), so ``log_model``'s own linking leaves them out."""
    client = mlflow.MlflowClient()
    client.log_outputs(run_id, models=[LoggedModelOutput(model_id, step=step)])
    linked = [
        Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, run_id=run_id,
               dataset_name=dataset.name, dataset_digest=dataset.digest)
        for key in client.get_run(run_id).data.metrics
        for m in client.get_metric_history(run_id, key)
        if m.step == step
    ]  # fmt: skip
    client.log_batch(run_id, metrics=linked)


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
        if mlflow_store.unreachable(err):
            raise  # the server did not answer: not "no such run"
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


def load_registered(model_uri: str):
    """The ``ModelBundle`` behind a registered version (``models:/gem-ranker@champion``)."""
    return mlflow.pyfunc.load_model(model_uri).unwrap_python_model().bundle
