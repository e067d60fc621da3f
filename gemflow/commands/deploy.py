"""Deploy commands for the online ranker: ``deploy``, ``smoke-test``, ``promote``, ``rollback-deploy``, ``undeploy``.

The CLI face of ``serving.rollout`` (deploy -> smoke test -> promote | roll back; ``--mode local`` or
``cluster``): each command is one rollout step, so each DAG task runs one. Exit codes (``gemflow.exit_codes``):
0 ok, 1 a step failed (smoke test, kubectl, rollback), 2 bad input.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated

import typer

from gemflow.commands.common import WorkspaceOpt, workspace
from gemflow.exit_codes import BAD_INPUT as BAD_INPUT_EXIT
from gemflow.exit_codes import FAILED as FAILED_EXIT

CHAMPION_URI = "models:/gem-ranker@champion"
ModeOpt = Annotated[
    str, typer.Option("--mode", help="local (a background gemflow serve) or cluster (kubectl).")
]
KubectlOpt = Annotated[str, typer.Option("--kubectl", help="kubectl binary (cluster mode).")]
PortOpt = Annotated[int, typer.Option(help="Local mode: HTTP port.")]
TrackingOpt = Annotated[str, typer.Option(help="MLflow tracking URI.")]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds to wait for the model to be ready.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Serving config override key=value (repeatable; cluster manifest)."),
]


def _fail(err: Exception, code: int = BAD_INPUT_EXIT) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(code=code)


def _rollout(
    mode: str, ws, *, port=8080, tracking_uri="", overrides=None, kubectl_bin="kubectl", timeout=300.0
):
    from serving.rollout.cluster import ClusterRollout
    from serving.rollout.local import LocalRollout

    if mode == "local":
        return LocalRollout(ws.root, port, tracking_uri, timeout)
    if mode == "cluster":
        return ClusterRollout(ws.root, list(overrides or []), kubectl_bin, timeout)
    raise _fail(ValueError(f"--mode must be local or cluster, got {mode!r}"))


def register(app: typer.Typer) -> None:
    @app.command("deploy")
    def deploy_cmd(
        mode: ModeOpt = "local",
        model_uri: Annotated[
            str, typer.Option(help="Ranker: a models:/ URI or a model.pt path.")
        ] = CHAMPION_URI,
        port: PortOpt = 8080,
        tracking_uri: TrackingOpt = "",
        overrides: SetOpt = None,
        kubectl_bin: KubectlOpt = "kubectl",
        timeout: TimeoutOpt = 300.0,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Pin the model and roll it out (local: restart the background server; cluster: apply the canary)."""
        from serving.rollout import steps
        from serving.rollout.base import RolloutError

        w = workspace(ws)
        rollout = _rollout(mode, w, port=port, tracking_uri=tracking_uri, overrides=overrides,
                           kubectl_bin=kubectl_bin, timeout=timeout)  # fmt: skip
        try:
            dep, changed = steps.deploy(rollout, w, model_uri, tracking_uri)
        except RolloutError as err:
            raise _fail(err, FAILED_EXIT) from err
        if not changed:
            typer.echo(f"{dep.version} is already live at {dep.url}: unchanged")
            return
        typer.echo(json.dumps(asdict(dep), indent=2))

    @app.command("smoke-test")
    def smoke_cmd(
        url: Annotated[str, typer.Option(help="Server base URL; default: the current deployment's.")] = "",
        users: Annotated[int, typer.Option(help="Users to rank for (sampled from the latest refresh).")] = 3,
        candidates: Annotated[int, typer.Option(help="Candidate ads per request.")] = 20,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Rank real candidates through the deployed server; exit 1 on any bad answer."""
        from serving.rollout import steps
        from serving.rollout.base import RolloutError

        w = workspace(ws)
        try:
            dep, problems = steps.smoke(w, url, users, candidates)
        except RolloutError as err:
            raise _fail(err) from err
        target = url or dep.url
        if problems:
            typer.echo("smoke test FAILED:\n  " + "\n  ".join(problems), err=True)
            raise typer.Exit(code=FAILED_EXIT)
        typer.echo(f"smoke test passed: {target} ({dep.version if dep else 'unknown version'})")

    @app.command("promote")
    def promote_cmd(
        mode: ModeOpt = "local", kubectl_bin: KubectlOpt = "kubectl", ws: WorkspaceOpt = None
    ) -> None:
        """Send all traffic to the deployed version (cluster: canary -> 100 %) and record it as live."""
        from serving.rollout import steps
        from serving.rollout.base import RolloutError, read_state

        w = workspace(ws)
        if read_state(w.root) is None:
            raise _fail(ValueError("nothing deployed to promote (no serving/deploy.json)"))
        try:
            dep = steps.promote(_rollout(mode, w, kubectl_bin=kubectl_bin), w)
        except RolloutError as err:
            raise _fail(err, FAILED_EXIT) from err
        typer.echo(f"{dep.version} promoted ({mode})")

    @app.command("rollback-deploy")
    def rollback_cmd(
        mode: ModeOpt = "local",
        port: PortOpt = 8080,
        tracking_uri: TrackingOpt = "",
        kubectl_bin: KubectlOpt = "kubectl",
        timeout: TimeoutOpt = 300.0,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Undo a failed rollout: @champion back to the version it replaced, and the previous deployment back."""
        from serving.rollout import steps
        from serving.rollout.base import RolloutError, read_state

        w = workspace(ws)
        if read_state(w.root) is None:
            raise _fail(ValueError("nothing deployed to roll back (no serving/deploy.json)"))
        rollout = _rollout(mode, w, port=port, tracking_uri=tracking_uri, kubectl_bin=kubectl_bin,
                           timeout=timeout)  # fmt: skip
        try:
            failed, live = steps.roll_back(rollout, w, tracking_uri)
        except RolloutError as err:
            raise _fail(err, FAILED_EXIT) from err
        typer.echo(f"rolled back {failed.version} -> {live.version} ({mode})")

    @app.command("undeploy")
    def undeploy_cmd(ws: WorkspaceOpt = None) -> None:
        """Stop the local background server."""
        from serving.rollout.local import stop_local

        w = workspace(ws)
        typer.echo("stopped" if stop_local(w.root) else "no local server running")
