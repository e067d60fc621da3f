"""Which workspace the MLflow UI of ``gemflow up`` shows, so that a command on another workspace can say so.

One MLflow server shows one store, and each workspace has its own (``models.tracking.mlflow_store``): its runs, and its
registry with its own ``gem-ranker@champion``. Commands on the workspace the platform runs on write to the very
SQLite store its MLflow server reads, so their runs are in its UI at once. A command on another workspace (a
second ``GEMFLOW_HOME``, or ``./workspace`` while ``make up`` runs on ``workspace/platform``) must not log into
the platform's store: its models would take the platform's registered names and aliases. Instead ``gemflow up``
records its workspace and UI address here, per user, and such a command logs one line naming both and how to
see its runs (``mlflow_store.resolve``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunningUi:
    workspace: Path
    mlflow_url: str


def record_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "gemflow" / "platform.json"


def record(workspace: Path, mlflow_url: str) -> None:
    """Called by ``gemflow up`` once its MLflow server answers."""
    path = record_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"workspace": str(workspace.resolve()), "mlflow_url": mlflow_url}))
    tmp.replace(path)


def forget(workspace: Path) -> None:
    """Called by ``gemflow down``: the record goes if it names this workspace (another ``up`` may have replaced it)."""
    found = _read()
    if found is not None and found.workspace == workspace.resolve():
        record_file().unlink(missing_ok=True)


def running() -> RunningUi | None:
    """The recorded platform's workspace and MLflow UI, if its MLflow server process still runs."""
    from gemflow.platform import Platform
    from gemflow.workspace import Workspace

    found = _read()
    if found is None:
        return None
    alive = any(s.name == "mlflow" for s in Platform(Workspace(found.workspace)).running())
    return found if alive else None


def _read() -> RunningUi | None:
    try:
        data = json.loads(record_file().read_text())
        return RunningUi(Path(data["workspace"]), str(data["mlflow_url"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
