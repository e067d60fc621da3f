"""Platform commands: ``up`` (Airflow 3 + MLflow server + ranker endpoint), ``down`` and ``status``.

See ``gemflow.platform``. Exit codes: 0 done; 1 a service failed to start or to stop (everything ``up`` had
started is stopped again); 2 bad input (a port taken, a bad config).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from gemflow.commands.common import ConfigOpt, SetOpt, WorkspaceOpt, config, workspace
from gemflow.exit_codes import BAD_INPUT, FAILED


def register(app: typer.Typer) -> None:
    @app.command("up")
    def up_cmd(cfg_path: ConfigOpt = None, overrides: SetOpt = None, ws: WorkspaceOpt = None) -> None:
        """Start the platform (Airflow API server + UI, scheduler, DAG processor, triggerer; MLflow UI; endpoint)."""
        import time

        from gemflow.platform import Platform
        from gemflow.services import PlatformError

        t0 = time.monotonic()
        p = Platform(workspace(ws), config(_cfg(), cfg_path, overrides))
        try:
            p.up(echo=typer.echo)
        except PlatformError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(
                BAD_INPUT if "already in use" in str(err) or "both" in str(err) else FAILED
            ) from err
        from models.tracking.mlflow_store import ui_link

        login = _airflow_login(p)
        typer.echo(
            f"\ngemflow is up in {time.monotonic() - t0:.0f}s (workspace {p.ws.root})\n"
            f"  Airflow UI      {p.airflow_url}   login {login}\n"
            f"  MLflow UI       {ui_link(p.mlflow_url)}\n"
            f"  ranker endpoint {p.endpoint_url}   (/docs; live once a ranker champion is deployed)\n"
            f"  event collector {p.events_url}   (POST /v1/events; gemflow land-synthetic --live streams a day)\n"
            f"  logs            {p.logs}/   task logs {p.airflow_home / 'logs'}/\n"
            f"  stop with       gemflow down{'' if ws is None else f' -w {p.ws.root}'}   (or make down)"
        )

    @app.command("down")
    def down_cmd(ws: WorkspaceOpt = None) -> None:
        """Stop everything `gemflow up` started from this workspace (tasks, ranks and the endpoint included)."""
        from gemflow.platform import Platform
        from gemflow.services import PlatformError

        try:
            Platform(workspace(ws)).down(echo=typer.echo)
        except PlatformError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(FAILED) from err

    @app.command("restart")
    def restart_cmd(
        service: Annotated[str, typer.Argument(help="A recorded service, e.g. airflow-scheduler or mlflow.")],
        ws: WorkspaceOpt = None,
    ) -> None:
        """Start one service of the running platform again (after a crash or a kill), same command and marker."""
        from gemflow.platform import Platform
        from gemflow.services import PlatformError

        try:
            Platform(workspace(ws)).restart(service, echo=typer.echo)
        except PlatformError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(FAILED) from err

    @app.command("wait")
    def wait_cmd(
        dag_id: Annotated[
            str, typer.Option("--dag", help="The DAG whose first successful run ends the wait.")
        ] = ("gemflow_deploy"),
        timeout: Annotated[float, typer.Option(help="Seconds.")] = 3600.0,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Follow the running platform's DAG runs until DAG has succeeded once (exit 1 on a failed run)."""
        import time

        from gemflow.platform import Platform
        from gemflow.services import PlatformError

        t0 = time.monotonic()
        try:
            Platform(workspace(ws)).wait_for(dag_id, timeout, echo=typer.echo)
        except PlatformError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(FAILED) from err
        typer.echo(f"{dag_id} succeeded after {time.monotonic() - t0:.0f}s of waiting")

    @app.command("status")
    def status_cmd(ws: WorkspaceOpt = None) -> None:
        """Print the recorded services (JSON) and whether each one still runs."""
        from gemflow.platform import Platform

        p = Platform(workspace(ws))
        state = p.read_state()
        if state is None:
            typer.echo("not running")
            raise typer.Exit(FAILED)
        live = {s.pid for s in p.running()}
        services = [{**s, "alive": s["pid"] in live} for s in state["services"]]
        typer.echo(json.dumps({**state, "services": services}, indent=2, default=str))


def _cfg():
    from gemflow.platform_env import PlatformConfig

    return PlatformConfig


def _airflow_login(p) -> str:
    """Airflow's simple auth manager writes the generated password of each user to a file under AIRFLOW_HOME."""
    path = p.airflow_home / "simple_auth_manager_passwords.json.generated"
    try:
        users = json.loads(path.read_text())
        user, password = next(iter(users.items()))
        return f"{user} / {password}  (from {path})"
    except (OSError, ValueError, StopIteration):
        return f"see {path}"
