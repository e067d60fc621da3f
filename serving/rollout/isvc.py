"""The InferenceService the cluster rollout applies: the chart's manifest (``GEMFLOW_RANKER_MANIFEST_FILE``, its
hardened pod spec, Redis secret and network labels) when a stage pod has it, else ``serving.manifest``'s render
of the serving config; in both, the model pinned and the canary revision given its own URL."""

from __future__ import annotations

import os
from pathlib import Path

MANIFEST_ENV = "GEMFLOW_RANKER_MANIFEST_FILE"
TAG_ROUTING = "serving.kserve.io/enable-tag-routing"


def set_model_uri(args: list[str], model_uri: str) -> list[str]:
    """``args`` of ``gemflow serve`` with the model replaced (``--set=model_uri=X`` or ``--set model_uri=X``)."""
    out, found = list(args), False
    for i, arg in enumerate(out):
        if arg.startswith("--set=model_uri="):
            out[i], found = f"--set=model_uri={model_uri}", True
        elif arg.startswith("model_uri=") and i and out[i - 1] in ("--set", "-s"):
            out[i], found = f"model_uri={model_uri}", True
    return out if found else [*out, f"--set=model_uri={model_uri}"]


def inference_service(model_uri: str, overrides: list[str], manifest_file: str = "") -> dict:
    import yaml

    from gemflow.config import load_config
    from serving.config import ServingConfig
    from serving.manifest import render

    cfg = load_config(ServingConfig, None, [*overrides, f"model_uri={model_uri}"])  # the model last: it wins
    manifest_file = manifest_file or os.environ.get(MANIFEST_ENV, "")
    if not manifest_file:
        manifest = render(cfg)
    else:
        manifest = yaml.safe_load(Path(manifest_file).read_text())
        predictor = manifest["spec"]["predictor"]
        container = predictor["containers"][0]
        container["args"] = set_model_uri(container["args"], model_uri)
        predictor.setdefault("canaryTrafficPercent", cfg.cluster.canary_traffic_percent)
        manifest["metadata"].setdefault(
            "namespace", os.environ.get("GEMFLOW_NAMESPACE", cfg.cluster.namespace)
        )
    meta = manifest["metadata"]
    meta.setdefault("labels", {})["app.kubernetes.io/managed-by"] = "gemflow-deploy"  # not Helm: we own it
    meta.setdefault("annotations", {})[TAG_ROUTING] = (
        "true"  # the canary's own "latest-" URL for the smoke test
    )
    return manifest
