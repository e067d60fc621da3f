"""Options and helpers shared by the stage commands."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from gemflow.config import ConfigError, load_config
from gemflow.workspace import Workspace

T = TypeVar("T")

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML file for the stage config.")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override one config key: key.sub=value (repeatable).")
]
WorkspaceOpt = Annotated[
    Path | None, typer.Option("--workspace", "-w", help="Data root (default $GEMFLOW_HOME or ./workspace).")
]


def workspace(path: Path | None) -> Workspace:
    return Workspace(path.resolve()) if path else Workspace.default()


def config(cls: type[T], path: Path | None, overrides: list[str] | None, **flags) -> T:
    """Defaults < file < --set < explicit flags (flags left at None do not override).

    An empty ``--config ""`` means "no file" (DAGs template the path and may leave it empty)."""
    if path is not None and str(path) in ("", "."):
        path = None
    if path is not None and not Path(path).is_file():
        raise typer.BadParameter(f"config file {path} does not exist")
    try:
        pairs = dict(_pairs(overrides or []))
        pairs.update({k: v for k, v in flags.items() if v is not None})
        return load_config(cls, path, pairs)
    except ConfigError as err:
        raise typer.BadParameter(str(err)) from err


def _pairs(overrides: list[str]):
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"--set {o!r} must look like key=value (e.g. train.lr=0.01)")
        key, value = o.split("=", 1)
        yield key.strip(), value


def write_event(extra: dict) -> None:
    """Metadata for the asset event of the Airflow task running this command (``GEMFLOW_EVENT_FILE``, set by
    ``dags/gemflow_stage.run_cli``); nothing outside a DAG task."""
    import json
    import os

    path = os.environ.get("GEMFLOW_EVENT_FILE")
    if path:
        Path(path).write_text(json.dumps(extra, default=str))


def parse_date(value: str) -> dt.date:
    try:
        return dt.date.fromisoformat(value)
    except ValueError as err:
        raise typer.BadParameter(f"{value!r} is not a date like 2026-01-31") from err
