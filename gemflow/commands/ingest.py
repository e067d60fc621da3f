"""Feature commands: ``ingest --date D`` (raw day -> gate -> offline store -> Feast) and ``build-training-set``.

``ingest`` exits 3 when the validation gate rejects the partition (the Airflow task turns that into a failure
without retries), 2 on bad input (missing partition, bad config), 0 otherwise; it prints its summary as JSON.
``ingest --start D1 --end D2`` (every raw partition in the range) or ``--dates D1,D2,...`` ingests many dates in
one process, oldest first, with the same per-date semantics; the first failing date stops it, named in the error,
with the same exit codes.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from gemflow import logs
from gemflow.commands.common import ConfigOpt, SetOpt, WorkspaceOpt, config, parse_date, workspace
from gemflow.exit_codes import BAD_INPUT as BAD_INPUT_EXIT
from gemflow.exit_codes import GATE_FAILED as GATE_FAILED_EXIT


def _logging() -> None:
    logs.setup()


def _fail(err: Exception, code: int = BAD_INPUT_EXIT) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(code=code)


def _ingest_one(ws, day, cfg) -> None:
    from features.ingest import ingest
    from features.ingestion.raw import IngestError
    from features.validation import ValidationGateError

    try:
        summary = ingest(ws, day, cfg)
    except ValidationGateError as err:
        raise _fail(err, GATE_FAILED_EXIT) from err
    except (IngestError, ValueError, FileNotFoundError) as err:
        raise _fail(err) from err
    typer.echo(json.dumps(summary, indent=2, default=str))


def _ingest_many(ws, cfg, start: str | None, end: str | None, dates: str | None) -> None:
    from features.ingest import DateIngestError, ingest_days
    from features.ingestion.raw import IngestError, raw_days
    from features.validation import ValidationGateError

    if dates:
        days = [parse_date(d.strip()) for d in dates.split(",") if d.strip()]
        if not days:
            raise typer.BadParameter(f"--dates {dates!r} names no date")
    elif not (start and end):
        raise typer.BadParameter("--start and --end go together")
    try:
        if not dates:
            days = raw_days(ws, parse_date(start), parse_date(end))
        summary = ingest_days(ws, days, cfg)
    except DateIngestError as err:
        if isinstance(err.cause, ValidationGateError):
            raise _fail(err, GATE_FAILED_EXIT) from err
        if isinstance(err.cause, IngestError | ValueError | FileNotFoundError):
            raise _fail(err) from err
        raise
    except (IngestError, ValueError) as err:
        raise _fail(err) from err
    typer.echo(json.dumps(summary, indent=2, default=str))


def register(app: typer.Typer) -> None:
    @app.command("ingest")
    def ingest_cmd(
        date: Annotated[
            str | None, typer.Option("--date", "-d", help="Logical date of the partition, e.g. 2026-01-31.")
        ] = None,
        start: Annotated[
            str | None,
            typer.Option(
                "--start", help="Ingest every raw partition from this date (with --end), in one process."
            ),
        ] = None,
        end: Annotated[
            str | None, typer.Option("--end", help="Last date of --start's range, inclusive.")
        ] = None,
        dates: Annotated[
            str | None, typer.Option("--dates", help="Comma-separated dates to ingest in one process.")
        ] = None,
        cfg_path: ConfigOpt = None,
        overrides: SetOpt = None,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Validate raw partition DATE (or every date of --start..--end / --dates, in one process), publish it
        to the offline store and Feast (idempotent per date)."""
        from features.ingest import IngestConfig

        modes = [
            name for name, v in (("--date", date), ("--start/--end", start or end), ("--dates", dates)) if v
        ]
        if len(modes) != 1:
            raise typer.BadParameter(
                "give exactly one of --date D, --start D1 --end D2, --dates D1,D2,..."
                + (f" (got {' and '.join(modes)})" if modes else "")
            )
        _logging()
        cfg = config(IngestConfig, cfg_path, overrides)
        if date:
            _ingest_one(workspace(ws), parse_date(date), cfg)
        else:
            _ingest_many(workspace(ws), cfg, start, end, dates)

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
        split: Annotated[
            str | None,
            typer.Option(
                "--split",
                help="time (the last days held out) or leave-one-out (per user: last positive -> test, the "
                "one before -> valid; positive-only logs). Default: the config's, else time.",
            ),
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
        cfg = config(TrainingSetConfig, cfg_path, overrides, start=start, end=end, name=name, split=split)
        try:
            manifest = build_training_set(workspace(ws), cfg)
        except (ValueError, FileNotFoundError) as err:
            raise _fail(err) from err
        typer.echo(
            json.dumps({k: manifest[k] for k in ("name", "start", "end", "counts", "files")}, indent=2)
        )
