"""Tracking server and registry commands: ``mlflow-server``, ``rollback`` (``register-run`` lives with the refresh commands)."""

from __future__ import annotations

from typing import Annotated

import typer

from gemflow.commands.common import WorkspaceOpt, workspace


def _use_tracking(ws, tracking_uri: str) -> None:
    from models.tracking import mlflow_store

    mlflow_store.use(ws, tracking_uri)


def register(app: typer.Typer) -> None:
    @app.command("mlflow-server")
    def mlflow_server(
        ws: WorkspaceOpt = None,
        host: Annotated[str, typer.Option(help="Interface to bind (loopback by default).")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="HTTP port.")] = 5000,
    ) -> None:
        """Start a real MLflow tracking server (SQLite backend, local artifacts) and print the UI address."""
        from models.tracking.mlflow_store import open_embedded
        from models.tracking.registry.server import start_server

        w = workspace(ws)
        open_embedded(w)  # created with the workspace's artifact root, or re-pointed after a move
        root = w.mlflow
        proc = start_server(root, host, port)
        typer.echo(f"MLflow UI: http://{host}:{port}  (backend {root / 'mlflow.db'}; Ctrl-C stops it)")
        typer.echo(f"Point stages at it with: export MLFLOW_TRACKING_URI=http://{host}:{port}")
        try:
            proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait(timeout=30)

    @app.command("rollback")
    def rollback_cmd(
        model: Annotated[str, typer.Option("--model", "-m", help="Registered model name.")] = "gem-ranker",
        ws: WorkspaceOpt = None,
        tracking_uri: Annotated[
            str, typer.Option(help="MLflow tracking URI (default: the workspace's).")
        ] = "",
    ) -> None:
        """Move @champion back to the version it replaced."""
        from models.tracking.registry import rollback

        _use_tracking(workspace(ws), tracking_uri)
        try:
            version = rollback(model)
        except ValueError as err:
            raise typer.BadParameter(str(err)) from err
        typer.echo(f"{model}@champion -> version {version}")
