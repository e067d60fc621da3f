"""The rollout protocol and the record of what is deployed (``<ws>/serving/deploy.json``)."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

MODEL_NAME = "gem-ranker"


class RolloutError(RuntimeError):
    """A rollout step failed; the message says which and why."""


@dataclass
class Deployment:
    mode: str  # local | cluster
    model_uri: str  # pinned: models:/gem-ranker/7 or a model.pt path
    version: str  # what the server reports serving ("gem-ranker/7"): served_version(model_uri)
    url: str  # where the smoke test reaches this version (cluster: the canary's own URL)
    status: str  # deployed | promoted
    pid: int = 0  # local: the server process
    manifest: str = ""  # cluster: the applied InferenceService manifest
    previous_uri: str = ""  # the promoted deployment this one replaced ("" = none)
    previous_version: str = ""
    at: str = ""


class Rollout(Protocol):
    """The steps a rollout is made of; each DAG task runs one of them."""

    mode: str

    def deploy(self, model_uri: str, version: str) -> tuple[str, int, str]:
        """Make ``model_uri`` (pinned) serve; returns (url reaching it, pid, manifest path)."""

    def is_live(self, dep: Deployment) -> bool:
        """``dep`` is already serving (a redeploy of it is a no-op)."""

    def promote(self, dep: Deployment) -> None:
        """Send all traffic to ``dep``."""

    def roll_back(self, dep: Deployment, target_uri: str, target_version: str) -> tuple[str, int]:
        """Take ``dep`` out of traffic; ``target_uri`` serves again. Returns (url, pid)."""


def serving_dir(root: Path) -> Path:
    return root / "serving"


def read_state(root: Path) -> Deployment | None:
    path = serving_dir(root) / "deploy.json"
    return Deployment(**json.loads(path.read_text())) if path.exists() else None


def write_state(root: Path, dep: Deployment) -> None:
    dep.at = dt.datetime.now(dt.UTC).isoformat()
    path = serving_dir(root) / "deploy.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(dep), indent=2))
    tmp.replace(path)
