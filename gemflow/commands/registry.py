"""Tracking server and registry commands: ``mlflow-server``, ``register`` (+ gate), ``rollback``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gemflow.commands.common import WorkspaceOpt, workspace


def _use_tracking(ws, tracking_uri: str) -> None:
    import mlflow

    from models.config import TrackingConfig
    from models.tracking import tracking_uri as default_uri

    mlflow.set_tracking_uri(tracking_uri or default_uri(TrackingConfig(), ws))


def register(app: typer.Typer) -> None:
    @app.command("mlflow-server")
    def mlflow_server(
        ws: WorkspaceOpt = None,
        host: Annotated[str, typer.Option(help="Interface to bind (loopback by default).")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="HTTP port.")] = 5000,
    ) -> None:
        """Start a real MLflow tracking server (SQLite backend, local artifacts) and print the UI address."""
        from models.registry.server import start_server

        root = workspace(ws).mlflow
        proc = start_server(root, host, port)
        typer.echo(f"MLflow UI: http://{host}:{port}  (backend {root / 'mlflow.db'}; Ctrl-C stops it)")
        typer.echo(f"Point stages at it with: export MLFLOW_TRACKING_URI=http://{host}:{port}")
        try:
            proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait(timeout=30)

    @app.command("register")
    def register_cmd(
        run_dir: Annotated[Path, typer.Argument(help="A training run folder holding model.pt.")],
        training_set: Annotated[
            Path,
            typer.Option("--training-set", "-t", help="Held-out data the gate judges on (its test split)."),
        ],
        ws: WorkspaceOpt = None,
        tracking_uri: Annotated[
            str, typer.Option(help="MLflow tracking URI (default: the workspace's).")
        ] = "",
        gate: Annotated[
            bool, typer.Option(help="Run the champion/challenger gate on the new version.")
        ] = True,
        min_gain: Annotated[
            float, typer.Option(help="Relative NE gain needed to replace the champion.")
        ] = 0.002,
        calibration_low: Annotated[float, typer.Option(help="Lowest acceptable calibration.")] = 0.8,
        calibration_high: Annotated[float, typer.Option(help="Highest acceptable calibration.")] = 1.25,
    ) -> None:
        """Register a trained model as @challenger; the gate promotes it to @champion only if it wins."""
        from models.registry import GateConfig, register_bundle, run_gate
        from models.registry.heldout import evaluator

        w = workspace(ws)
        _use_tracking(w, tracking_uri)
        training_set = training_set if training_set.is_dir() else w.training(str(training_set))
        version = register_bundle(run_dir, training_set)
        typer.echo(f"registered {version.uri} (run {version.run_id})")
        if not gate:
            return
        cfg = GateConfig(min_gain, calibration_low, calibration_high)
        decision = run_gate(version.name, version.version, evaluator(training_set), cfg)
        verdict = "PROMOTED to @champion" if decision.promoted else "stays @challenger"
        typer.echo(f"gate: {version.name} v{version.version} {verdict}: {decision.reason}")

    @app.command("rollback")
    def rollback_cmd(
        model: Annotated[str, typer.Option("--model", "-m", help="Registered model name.")] = "gem-ranker",
        ws: WorkspaceOpt = None,
        tracking_uri: Annotated[
            str, typer.Option(help="MLflow tracking URI (default: the workspace's).")
        ] = "",
    ) -> None:
        """Move @champion back to the version it replaced."""
        from models.registry import rollback

        _use_tracking(workspace(ws), tracking_uri)
        try:
            version = rollback(model)
        except ValueError as err:
            raise typer.BadParameter(str(err)) from err
        typer.echo(f"{model}@champion -> version {version}")
