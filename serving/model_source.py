"""Loading the ranker to serve: from the MLflow registry (``models:/gem-ranker@champion``) or a local bundle.

Registry models are logged pickle-free (state dict + JSON spec, ``models.tracking.registry``); this process refuses pickle
deserialization outright (``MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false``) so a pickled artifact can never run
here. A local path (a ``model.pt`` bundle or its run folder, ``models.inference.bundle``) serves a model straight from
training, e.g. before it is registered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gemflow.workspace import Workspace
from models.architectures.ranker import Ranker
from models.training.dense import DenseSpec


@dataclass
class ServedModel:
    ranker: Ranker
    dense: DenseSpec  # candidate dense features and their normalization, as trained
    version: str  # what the response reports (registry version or run name)
    user_model_version: str  # the user model whose cached tokens the ranker was trained on ("" = none)
    uri: str
    vocabularies: dict = field(default_factory=dict)  # raw id -> model row (``serving.id_rows``)

    @property
    def cfg(self):
        return self.ranker.cfg


class ModelLoadError(RuntimeError):
    pass


def load_served_model(uri: str, tracking_uri: str = "", ws: Workspace | None = None) -> ServedModel:
    """A registry URI is read from ``ws``'s store (``tracking_uri`` if given; ``models.tracking.mlflow_store``)."""
    os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = "false"
    if uri.startswith(("models:/", "runs:/", "mlflow-artifacts:/")):
        served = _from_mlflow(uri, tracking_uri, ws)
    else:
        served = _from_bundle(uri)
    if not isinstance(served.ranker, Ranker):
        raise ModelLoadError(f"{uri} is a {type(served.ranker).__name__}, not the online ranker")
    served.ranker.eval()
    return served


def _from_bundle(path: str) -> ServedModel:
    from models.inference.bundle import load_bundle

    try:
        bundle = load_bundle(Path(path))
    except FileNotFoundError as err:
        raise ModelLoadError(str(err)) from err
    if bundle.kind != "ranker":
        raise ModelLoadError(f"{path} holds a {bundle.kind} model, not the ranker")
    return ServedModel(
        bundle.model, bundle.dense, bundle.version, bundle.user_model_version or "", path, bundle.vocabularies
    )


def _from_mlflow(uri: str, tracking_uri: str, ws: Workspace | None) -> ServedModel:
    import mlflow
    from mlflow.exceptions import MlflowException

    from models.tracking.mlflow_store import connect

    connect(ws, tracking_uri)
    try:
        pyfunc = mlflow.pyfunc.load_model(uri)
    except MlflowException as err:
        raise ModelLoadError(f"cannot load {uri} from {mlflow.get_tracking_uri()}: {err.message}") from err
    wrapper = pyfunc.unwrap_python_model()
    spec = getattr(wrapper, "spec", {}).get("model_config", {})
    if "dense" not in spec:
        raise ModelLoadError(
            f"{uri}: its logged spec has no dense-feature normalization ('dense'): not a ranker"
        )
    version = str(pyfunc.metadata.model_id or uri) if hasattr(pyfunc, "metadata") else uri
    version = _registry_version(uri) or spec.get("version") or version
    return ServedModel(
        wrapper.model, DenseSpec(**spec["dense"]), version, str(spec.get("user_model_version") or ""), uri,
        wrapper.bundle.vocabularies,
    )  # fmt: skip


def _registry_version(uri: str) -> str | None:
    """``models:/name@alias`` or ``models:/name/3`` -> "name/3"."""
    if not uri.startswith("models:/"):
        return None
    from mlflow import MlflowClient

    ref = uri.removeprefix("models:/")
    client = MlflowClient()
    try:
        if "@" in ref:
            name, alias = ref.split("@", 1)
            return f"{name}/{client.get_model_version_by_alias(name, alias).version}"
        if "/" in ref:
            return ref
    except Exception:  # noqa: BLE001 (the version label is informative only)
        return None
    return None
