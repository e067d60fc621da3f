"""Feature commands: ``ingest --date D`` (raw day -> gate -> offline store -> Feast) and ``build-training-set``.

``ingest`` exits 3 when the validation gate rejects the partition (the Airflow task turns that into a failure
without retries), 2 on bad input (missing partition, bad config), 0 otherwise; it prints its summary as JSON.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated

import typer

from gemflow.commands.common import ConfigOpt, SetOpt, WorkspaceOpt, config, parse_date, workspace

GATE_FAILED_EXIT = 3  # the DAGs' gemflow_stage.GATE_FAILED_EXIT expects this code
BAD_INPUT_EXIT = 2


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("feast", "great_expectations", "ibis"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _fail(err: Exception, code: int = BAD_INPUT_EXIT) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(code=code)


def register(app: typer.Typer) -> None:
    @app.command("ingest")
    def ingest_cmd(
        date: Annotated[
            str, typer.Option("--date", "-d", help="Logical date of the partition, e.g. 2026-01-31.")
        ],
        cfg_path: ConfigOpt = None,
        overrides: SetOpt = None,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Validate raw partition DATE, publish it to the offline store and Feast (idempotent per date)."""
        from features.ingest import IngestConfig, IngestError, ingest
        from features.validation import ValidationGateError

        _logging()
        day = parse_date(date)
        cfg = config(IngestConfig, cfg_path, overrides)
        try:
            summary = ingest(workspace(ws), day, cfg)
        except ValidationGateError as err:
            raise _fail(err, GATE_FAILED_EXIT) from err
        except (IngestError, ValueError, FileNotFoundError) as err:
            raise _fail(err) from err
        typer.echo(json.dumps(summary, indent=2, default=str))

    @app.command("build-training-set")
    def build_training_set_cmd(
        start: Annotated[
            str | None,
            typer.Option("--start", help="First example day, e.g. 2026-01-01 (default: the first ingested)."),
        ] = None,
        end: Annotated[
            str | None,
            typer.Option("--end", help="Last example day, inclusive (default: the latest ingested)."),
        ] = None,
        name: Annotated[
            str | None, typer.Option("--name", "-n", help="Folder under <workspace>/training/.")
        ] = None,
        cfg_path: ConfigOpt = None,
        overrides: SetOpt = None,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Examples, jagged histories and point-in-time features for [START, END] -> <workspace>/training/NAME."""
        from features.training_sets import TrainingSetConfig, build_training_set

        _logging()
        for value in (start, end):
            if value is not None:
                parse_date(value)
        cfg = config(TrainingSetConfig, cfg_path, overrides, start=start, end=end, name=name)
        try:
            manifest = build_training_set(workspace(ws), cfg)
        except (ValueError, FileNotFoundError) as err:
            raise _fail(err) from err
        typer.echo(
            json.dumps({k: manifest[k] for k in ("name", "start", "end", "counts", "files")}, indent=2)
        )
