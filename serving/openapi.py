"""The ranker endpoint's OpenAPI 3.1 document, built from the gateway's own route tables.

``serving.gateway`` answers its routes itself (KServe's FastAPI schema describes KServe's routes, most of which
the gateway answers 404), so the document is derived from the tables the gateway dispatches on: a route added
there without a description here fails at start (``KeyError``), and ``tests/serving/test_server.py`` calls every
documented operation on a real server. ``GET /docs/openapi.json`` serves it; ``GET /docs`` renders it.
"""

from __future__ import annotations

import re

from serving.schema import RankRequest

# what each route label does; "token": the bearer token is required (when the server has one)
OPERATIONS = {
    "v1_predict": ("rank candidates (V1): the body is a ranking request, or {'instances': [it]}", True),
    "v2_infer": ("rank candidates (Open Inference Protocol)", True),
    "ready": ("model readiness, with the feature store's and the ad table's state", False),
    "metadata": ("model metadata: inputs, outputs, version", True),
    "stats": ("request and latency statistics", True),
    "live": ("server liveness", False),
    "server_ready": (
        "server readiness (true even while the model is not: probe the model's own ready route)",
        False,
    ),
    "server_metadata": ("server metadata (KServe)", False),
    "metrics": ("Prometheus metrics", False),
}
ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}


def model_path(pattern: re.Pattern, name: str) -> str:
    """A gateway route pattern with the served model's name in place of its one group."""
    return re.sub(r"\(\[\^[^)]*\]\+\)", name, pattern.pattern)


def document(name: str, version: str, model_routes, open_routes: dict[str, str]) -> dict:
    """``model_routes``: the gateway's ``(method, pattern, label)``; ``open_routes``: KServe's paths it passes on,
    each with its label."""
    request = RankRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas = {**request.pop("$defs", {}), "RankRequest": request, "Error": ERROR}
    paths: dict[str, dict] = {}
    for method, pattern, label in model_routes:
        paths.setdefault(model_path(pattern, name), {})[method.lower()] = _operation(label)
    for path, label in open_routes.items():
        paths.setdefault(path, {})["get"] = _operation(label)
    paths[model_path(next(p for _, p, lb in model_routes if lb == "v1_predict"), name)]["post"]["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": {"oneOf": [
            {"$ref": "#/components/schemas/RankRequest"},
            {"type": "object", "additionalProperties": False, "required": ["instances"],
             "properties": {"instances": {"type": "array", "minItems": 1, "maxItems": 1,
                                          "items": {"$ref": "#/components/schemas/RankRequest"}}}},
        ]}}},
    }  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": f"{name} ranker endpoint", "version": str(version)},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _operation(label: str) -> dict:
    summary, token = OPERATIONS[label]
    operation = {
        "operationId": label,
        "summary": summary,
        "responses": {"200": {"description": "OK"}, "4XX": _error("client mistake")},
    }
    if token:
        operation["security"] = [{"bearer": []}]
        operation["responses"]["401"] = _error("missing or wrong bearer token")
    return operation


def _error(what: str) -> dict:
    return {
        "description": what,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
