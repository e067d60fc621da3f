"""The KServe InferenceService of the online ranker, rendered from the same ``ServingConfig`` as ``gemflow serve``.

A custom predictor container (the project image running ``gemflow serve``) loads the champion itself: KServe's
``mlflow``/``pytorch`` model formats depend on servers that are unmaintained or being deprecated. Knative mode,
because ``canaryTrafficPercent`` only works there; the readiness probe hits the model's own ready endpoint
(``/v2/health/ready`` is true even when the model is not). On a cluster the online store is Redis.
"""

from __future__ import annotations

import yaml

from serving.config import ServingConfig

CONTAINER = "kserve-container"


def render(cfg: ServingConfig) -> dict:
    c = cfg.cluster
    port = cfg.http_port
    args = [
        "serve",
        "--host", "0.0.0.0",  # inside the pod; the local default is 127.0.0.1
        "--http-port", str(port),
        "--set", f"model_name={cfg.model_name}",
        "--set", f"model_uri={cfg.model_uri}",
        "--set", f"tracking_uri={c.mlflow_tracking_uri}",
        "--set", "feature_store.online_store=redis",
        "--set", f"feature_store.redis_connection={c.redis_connection}",
        "--set", f"limits.max_candidates={cfg.limits.max_candidates}",
        "--set", f"limits.max_body_bytes={cfg.limits.max_body_bytes}",
        "--set", f"limits.feature_timeout_ms={cfg.limits.feature_timeout_ms}",
        "--set", f"limits.request_timeout_ms={cfg.limits.request_timeout_ms}",
        "--set", f"limits.max_in_flight={cfg.limits.max_in_flight}",
        "--set", f"limits.body_timeout_ms={cfg.limits.body_timeout_ms}",
        "--set", f"connections.header_timeout_s={cfg.connections.header_timeout_s}",
        "--set", f"connections.idle_timeout_s={cfg.connections.idle_timeout_s}",
        "--set", f"connections.max_header_bytes={cfg.connections.max_header_bytes}",
        "--set", f"connections.max_headers={cfg.connections.max_headers}",
        "--set", "connections.max_per_client=0",  # in the pod every connection comes from Knative's queue-proxy
    ]  # fmt: skip
    if cfg.expected_user_model_version:
        args += ["--set", f"expected_user_model_version={cfg.expected_user_model_version}"]
    probe_path = f"/v2/models/{cfg.model_name}/ready"
    container = {
        "name": CONTAINER,
        "image": c.image,
        "command": ["gemflow"],
        "args": args,
        "ports": [{"name": "http1", "containerPort": port, "protocol": "TCP"}],
        "env": [
            {"name": "MLFLOW_TRACKING_URI", "value": c.mlflow_tracking_uri},
            {"name": "MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "value": "false"},
            {"name": "MLFLOW_DISABLE_TELEMETRY", "value": "true"},
            {"name": "GEMFLOW_HOME", "value": "/data/gemflow"},
            {"name": "OMP_NUM_THREADS", "value": str(cfg.scoring.torch_threads)},
        ],
        "resources": {
            "requests": {"cpu": c.cpu_request, "memory": c.memory_request},
            "limits": {"cpu": c.cpu_limit, "memory": c.memory_limit},
        },
        "readinessProbe": {
            "httpGet": {"path": probe_path, "port": port},
            "initialDelaySeconds": 5,
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/v2/health/live", "port": port},
            "initialDelaySeconds": 30,
            "periodSeconds": 10,
            "timeoutSeconds": 2,
            "failureThreshold": 6,
        },
    }
    predictor: dict = {
        "minReplicas": c.min_replicas,
        "maxReplicas": c.max_replicas,
        "canaryTrafficPercent": c.canary_traffic_percent,
        "containers": [container],
    }
    if c.service_account:
        predictor["serviceAccountName"] = c.service_account
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {
            "name": cfg.model_name,
            "namespace": c.namespace,
            "labels": {"app.kubernetes.io/part-of": "gemflow", "app.kubernetes.io/component": "ranker"},
            "annotations": {"serving.kserve.io/deploymentMode": "Knative"},
        },
        "spec": {"predictor": predictor},
    }


def render_yaml(cfg: ServingConfig) -> str:
    return yaml.safe_dump(render(cfg), sort_keys=False)
