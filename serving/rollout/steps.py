"""The rollout steps the CLI (and so each DAG task) runs, the same for both modes: deploy, smoke test, promote,
roll back. Each reads and writes ``<ws>/serving/deploy.json``, so the steps can run in separate processes."""

from __future__ import annotations

import logging

from serving.rollout.base import Deployment, Rollout, RolloutError, read_state, write_state
from serving.rollout.smoke import smoke_test
from serving.rollout.version import pin, served_version

log = logging.getLogger(__name__)


def deploy(rollout: Rollout, ws, model_uri: str, tracking_uri: str = "") -> tuple[Deployment, bool]:
    """Pin ``model_uri`` and make it serve. Returns the deployment and whether anything changed."""
    pinned = pin(model_uri, tracking_uri, ws)
    version = served_version(pinned)
    live = read_state(ws.root)
    if live and live.mode == rollout.mode and live.model_uri == pinned and rollout.is_live(live):
        return live, False
    url, pid, manifest = rollout.deploy(pinned, version)
    dep = Deployment(rollout.mode, pinned, version, url, "deployed", pid, manifest)
    previous = live if live and live.status == "promoted" else None
    if previous and previous.model_uri != pinned:
        dep.previous_uri, dep.previous_version = previous.model_uri, previous.version
    elif live:  # redeploying the live model, or replacing one never promoted: keep what it replaced
        dep.previous_uri, dep.previous_version = live.previous_uri, live.previous_version
    write_state(ws.root, dep)
    return dep, True


def current(ws) -> Deployment:
    dep = read_state(ws.root)
    if dep is None:
        raise RolloutError("nothing deployed (no serving/deploy.json): run `gemflow deploy` first")
    return dep


def smoke(ws, url: str = "", users: int = 3, candidates: int = 20) -> tuple[Deployment | None, list[str]]:
    """Smoke-test ``url`` (default: the current deployment's) against the version deployed there."""
    dep = read_state(ws.root)
    if not url and dep is None:
        raise RolloutError("nothing deployed (no serving/deploy.json): pass --url or run `gemflow deploy`")
    return dep, smoke_test(ws, url or dep.url, dep.version if dep else "", users, candidates)


def promote(rollout: Rollout, ws) -> Deployment:
    dep = current(ws)
    rollout.promote(dep)
    dep.status = "promoted"
    write_state(ws.root, dep)
    return dep


def roll_back(rollout: Rollout, ws, tracking_uri: str = "") -> tuple[Deployment, Deployment]:
    """Undo a failed rollout: @champion back to the version it replaced, and the previous deployment back.
    Returns (the failed deployment, the one now live)."""
    dep = current(ws)
    registry_target = _registry_rollback(dep, tracking_uri, ws)
    target = registry_target or dep.previous_uri
    if not target:
        raise RolloutError(f"{dep.version} replaced no earlier deployment: nothing to roll back to")
    if rollout.mode == "cluster" and dep.previous_uri and target != dep.previous_uri:
        log.warning("the registry rolled back to %s; the cluster returns to the previous revision %s",
                    target, dep.previous_uri)  # fmt: skip
        target = dep.previous_uri
    version = served_version(target)
    url, pid = rollout.roll_back(dep, target, version)
    live = Deployment(rollout.mode, target, version, url, "promoted", pid, dep.manifest)
    write_state(ws.root, live)
    return dep, live


def _registry_rollback(dep: Deployment, tracking_uri: str, ws) -> str:
    """If the failed version is the registry's @champion, move the alias back (``gemflow rollback``)."""
    from models.embeddings.refresh import MODEL_URI
    from models.tracking.mlflow_store import connect

    match = MODEL_URI.match(dep.model_uri)
    if not match or not match["version"]:
        return ""
    from mlflow.exceptions import MlflowException

    from models.tracking.registry import champion_version, rollback

    client = connect(ws, tracking_uri)
    if champion_version(client, match["name"]) != match["version"]:
        return ""
    try:
        return f"models:/{match['name']}/{rollback(match['name'], client)}"
    except (ValueError, MlflowException):
        return ""  # no earlier champion: fall back to the previous deployment, if any
