"""Probes of the platform's services: is a port free, does a URL answer, which version is the champion."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

from gemflow.workspace import Workspace


def port_free(host: str, port: int) -> bool:
    """True when nothing listens on ``host:port`` (nor on the wildcard address, which would shadow it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) != 0


def http_ok(url: str, timeout: float = 3.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
            return json.loads(body) if body.strip().startswith(b"{") else {"status": r.status}
    except (OSError, ValueError, urllib.error.HTTPError):
        return None


def champion_version(ws: Workspace, name: str) -> str | None:
    """The version ``name@champion`` points at in the workspace's registry, None when there is none."""
    import warnings

    from mlflow.exceptions import MlflowException

    from models.tracking.mlflow_store import connect

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SQLAlchemy deprecations inside MLflow's store, not ours
        try:
            return str(connect(ws).get_model_version_by_alias(name, "champion").version)
        except MlflowException:
            return None
