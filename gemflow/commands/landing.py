"""Embedded-mode scheduling commands: ``land-synthetic`` (the day that just ended lands as raw logs) and
``train-due`` (the trigger rule that keeps a backfill from training once per ingested day).

``land-synthetic --date D`` is what the ``gemflow_land`` DAG runs on the embedded default: the synthetic source
is generated from its epoch (``--epoch``, the platform's first day) through D with a fixed seed, so day D is the
same file whatever day it is landed on (the generator carries users' state across days), and only the partitions
of D are moved into ``<ws>/raw/<table>/date=D`` — events last, one rename each, so the ingest's sensor, which
waits for the events partition, never sees a half-written day. A real deployment lands its own logs instead.
``--live RATE`` streams D's events to the live event path instead (``features.sources.live``): the demo of a
ranking that changes seconds after a click; the collector's export lands them for D's ingest.

``train-due`` exits 0 when the stage should train and 4 (``UNCHANGED``: the task is skipped, so the training is
too) otherwise, with the reason on one line. See ``gemflow.schedule`` for the rule.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from gemflow.commands.common import ConfigOpt, SetOpt, WorkspaceOpt, config, parse_date, workspace
from gemflow.exit_codes import BAD_INPUT, UNCHANGED
from gemflow.workspace import Workspace

TABLES = ("users", "ads", "events")  # events last: the ingest's sensor waits for it


def land_day(cfg, ws: Workspace, day: dt.date, epoch: dt.date, live=None) -> dict:
    """Generate epoch..day in a scratch workspace; move day's partitions into ``ws``. Idempotent per day.

    ``live``: a callable taking the day's events table; the events partition is then handed to it (streamed to
    the live event path) instead of being moved into ``ws``."""
    import pyarrow.parquet as pq

    from features.sources.synthetic import generate

    if day < epoch:
        raise ValueError(f"--date {day} is before the synthetic source's epoch {epoch}")
    cfg.start_date = epoch.isoformat()
    cfg.days = (day - epoch).days + 1
    ws.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".landing-", dir=ws.root) as tmp:
        scratch = Workspace(Path(tmp))
        summary = generate(cfg, scratch, progress=False)
        for table in TABLES:
            src, dst = scratch.raw(table, day), ws.raw(table, day)
            if not src.exists():
                raise RuntimeError(f"the generator wrote no {table} partition for {day}")
            if table == "events" and live is not None:
                streamed = live(pq.read_table(src))
                return {"day": day.isoformat(), "epoch": epoch.isoformat(), "live": streamed,
                        "generated_days": cfg.days, "seconds": summary.get("seconds")}  # fmt: skip
            if dst.exists():
                shutil.rmtree(dst)
            dst.parent.mkdir(parents=True, exist_ok=True)
            src.rename(dst)
    events = sum(1 for _ in ws.raw("events", day).glob("*.parquet"))
    return {"day": day.isoformat(), "epoch": epoch.isoformat(), "event_files": events,
            "generated_days": cfg.days, "seconds": summary.get("seconds")}  # fmt: skip


def register(app: typer.Typer) -> None:
    @app.command("land-synthetic")
    def land_cmd(
        date: Annotated[str, typer.Option("--date", "-d", help="The day to land (the day that just ended).")],
        epoch: Annotated[
            str, typer.Option(help="The synthetic source's first day (the platform's start date).")
        ] = "2026-01-01",
        live: Annotated[
            float,
            typer.Option(
                "--live",
                help="Stream the day's events to the event collector at this many events/s (in time order) "
                "instead of landing them as a file; users and ads land as usual. 0 = off.",
            ),
        ] = 0.0,
        events_url: Annotated[
            str,
            typer.Option(
                "--events-url", envvar="GEMFLOW_EVENTS_URL", help="The collector (`gemflow events serve`)."
            ),
        ] = "http://127.0.0.1:8090",
        cfg_path: ConfigOpt = None,
        overrides: SetOpt = None,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Land one day of synthetic raw logs (users, ads, events) into the workspace.

        With --live, the events go to the live event path instead (token: $GEMFLOW_EVENTS_TOKEN)."""
        import os

        from features.sources.synthetic import SyntheticConfig

        cfg = config(SyntheticConfig, cfg_path, overrides)
        stream = None
        if live < 0:
            raise typer.BadParameter(f"--live must be >= 0 events/s, got {live}")
        if live > 0:
            from features.sources.live import stream_events

            def progress(done: int, total: int) -> None:
                typer.echo(f"streamed {done}/{total} events", err=True)

            def stream(table):
                token = os.environ.get("GEMFLOW_EVENTS_TOKEN") or None
                return stream_events(table, events_url, live, token, progress=progress)

        try:
            out = land_day(cfg, workspace(ws), parse_date(date), parse_date(epoch), stream)
        except (ValueError, RuntimeError) as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(BAD_INPUT) from err
        typer.echo(json.dumps(out))

    @app.command("train-due")
    def due_cmd(
        kind: Annotated[str, typer.Option(help="user or ranker.")],
        through: Annotated[
            str,
            typer.Option(
                help="The newest day the triggering event(s) name (YYYY-MM-DD); '' = newest ingested."
            ),
        ] = "",
        min_days: Annotated[int, typer.Option(help="Ingested days needed (train + valid + test).")] = 3,
        every_days: Annotated[
            int, typer.Option(help="Retrain once the last training's data is this many days old.")
        ] = 1,
        reason_key: Annotated[
            str,
            typer.Option(help="Also due when this value differs from the last training's (e.g. a version)."),
        ] = "",
        record: Annotated[
            bool, typer.Option(help="Record a finished training through --through instead.")
        ] = False,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Exit 0 when a training is due, 4 (skip) when not; one line says why."""
        from gemflow.schedule import TrainDue, decide, record_training

        w = workspace(ws)
        try:
            day = parse_date(through) if through else None
            if record:
                typer.echo(json.dumps(record_training(w, kind, day, reason_key)))
                return
            verdict = decide(w, TrainDue(kind, day, min_days, every_days, reason_key))
        except ValueError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(BAD_INPUT) from err
        typer.echo(("train: " if verdict.due else "nothing to do: ") + verdict.reason)
        if not verdict.due:
            raise typer.Exit(UNCHANGED)
