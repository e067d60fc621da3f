"""``gemflow events serve``: the live event collector (``serving.events``), and ``gemflow events export``: one
export of its durable log into the raw event log (the service also does it every ``export_every_s``)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from gemflow.commands.common import ConfigOpt, SetOpt, WorkspaceOpt, config, workspace

events_app = typer.Typer(help="The live event path: impressions, clicks and conversions as they happen.")


@events_app.command("serve")
def serve_cmd(
    cfg_path: ConfigOpt = None,
    overrides: SetOpt = None,
    ws: WorkspaceOpt = None,
    host: Annotated[
        str | None, typer.Option("--host", help="Address to bind (default 127.0.0.1; 0.0.0.0 inside a pod).")
    ] = None,
    port: Annotated[int | None, typer.Option("--port", help="HTTP port (default 8090).")] = None,
) -> None:
    """Serve POST /v1/events until interrupted. Set GEMFLOW_EVENTS_TOKEN to require a bearer token."""
    from serving.events.app import serve
    from serving.events.config import EventsConfig

    serve(config(EventsConfig, cfg_path, overrides, host=host, port=port), workspace(ws))


@events_app.command("export")
def export_cmd(cfg_path: ConfigOpt = None, overrides: SetOpt = None, ws: WorkspaceOpt = None) -> None:
    """Export the logged events not exported yet into <workspace>/raw/live_events/date=D/ (idempotent)."""
    from serving.events.app import log_path
    from serving.events.config import EventsConfig
    from serving.events.export import export
    from serving.events.log import connect

    w = workspace(ws)
    path = log_path(config(EventsConfig, cfg_path, overrides), w)
    if not path.exists():
        raise typer.BadParameter(f"no event log at {path}")
    conn = connect(path)
    try:
        typer.echo(json.dumps(export(conn, w)))
    finally:
        conn.close()


def register(app: typer.Typer) -> None:
    app.add_typer(events_app, name="events")
