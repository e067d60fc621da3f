"""The InferenceService renders from the serving config and deserializes into the KServe SDK's model."""

from __future__ import annotations

import yaml

from serving.config import ClusterConfig, ServingConfig
from serving.manifest import render, render_yaml


def _known_fields(obj: dict, cls_name: str, path: str = "") -> list[str]:
    """Every key of ``obj`` must be a field of the KServe / Kubernetes SDK class (strict, recursive)."""
    import kserve
    import kubernetes.client as k8s

    cls = getattr(kserve, cls_name, None) or getattr(k8s, cls_name)
    by_json = {v: k for k, v in cls.attribute_map.items()}
    problems = []
    for key, value in obj.items():
        if key not in by_json:
            problems.append(f"{path}.{key}")
            continue
        hint = cls.openapi_types[by_json[key]]
        if isinstance(value, dict) and hint.startswith("V1"):
            problems += _known_fields(value, hint, f"{path}.{key}")
        elif isinstance(value, list) and hint.startswith("list[V1"):
            for i, item in enumerate(value):
                problems += _known_fields(item, hint[5:-1], f"{path}.{key}[{i}]")
    return problems


def test_inference_service_is_knative_canary_with_model_probe():
    cfg = ServingConfig(cluster=ClusterConfig(canary_traffic_percent=20, image="registry/gemflow:1.2.3"))
    isvc = render(cfg)
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Knative"
    pred = isvc["spec"]["predictor"]
    assert pred["canaryTrafficPercent"] == 20
    (container,) = pred["containers"]
    assert container["image"] == "registry/gemflow:1.2.3"
    assert container["command"] == ["gemflow"] and container["args"][0] == "serve"
    assert "model_uri=models:/gem-ranker@champion" in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/models/gem-ranker/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["args"][1:3] == ["--host", "0.0.0.0"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] == "false"
    assert container["resources"]["limits"]["cpu"] == "2"
    assert yaml.safe_load(render_yaml(cfg)) == isvc


def test_manifest_fields_exist_in_the_kserve_sdk():
    isvc = render(ServingConfig())
    assert _known_fields(isvc, "V1beta1InferenceService") == []
