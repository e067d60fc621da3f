"""One version string for deployer and server: pin the model, then name it as ``gemflow serve`` will.

``serving.model_source`` labels a registry model ``name/N`` and a bundle by its own ``version``; the smoke test
compares the label the server reports with ``served_version`` of the pinned URI, computed by the same rules
(``serving.model_source._registry_version`` itself for registry URIs, so the two cannot drift apart).
"""

from __future__ import annotations

from pathlib import Path

from serving.rollout.base import RolloutError


def pin(model_uri: str, tracking_uri: str, ws) -> str:
    """``models:/name@alias`` -> ``models:/name/<its version now>``; anything else unchanged."""
    from models.embeddings.refresh import MODEL_URI
    from models.tracking.mlflow_store import connect

    match = MODEL_URI.match(model_uri)
    if not match or not match["alias"]:
        return model_uri
    from mlflow.exceptions import MlflowException

    try:
        mv = connect(ws, tracking_uri).get_model_version_by_alias(match["name"], match["alias"])
    except MlflowException as err:
        raise RolloutError(f"cannot resolve {model_uri}: {err.message}") from err
    return f"models:/{match['name']}/{mv.version}"


def served_version(pinned_uri: str) -> str:
    """The version ``gemflow serve`` reports when it serves ``pinned_uri``."""
    from models.embeddings.refresh import MODEL_URI

    match = MODEL_URI.match(pinned_uri)
    if match:
        if match["alias"]:
            raise RolloutError(
                f"{pinned_uri} is an alias: pin it first (a restart must not change the model)"
            )
        from serving.model_source import _registry_version

        return _registry_version(pinned_uri)
    if pinned_uri.startswith(("runs:/", "models:/", "mlflow-artifacts:/")):
        raise RolloutError(f"{pinned_uri}: deploy a registry version (models:/name/N) or a model.pt bundle")
    return _bundle_version(Path(pinned_uri))


def _bundle_version(path: Path) -> str:
    import torch

    from models.inference.bundle import MODEL_FILE

    file = path / MODEL_FILE if path.is_dir() else path
    if not file.exists():
        raise RolloutError(f"no ranker bundle at {file}")
    return str(torch.load(file, map_location="cpu", weights_only=True)["version"])
