"""Deploy commands for the online ranker: ``deploy``, ``smoke-test``, ``promote``, ``rollback-deploy``, ``undeploy``.

Two modes, one flow (render -> apply/start -> smoke test -> promote or roll back):
- ``local``: ``gemflow serve`` runs in the background (pid file + log under ``<ws>/serving/``); a laptop has no
  traffic split, so the new version takes all traffic at once and "promote" only records it as live.
- ``cluster``: the rendered InferenceService (Knative mode, ``canaryTrafficPercent`` from the serving config,
  tag routing on so the canary has its own ``latest-`` URL) is applied with ``kubectl`` (the stage pod's service
  account needs rights on ``inferenceservices``); promote patches the canary to 100 %, a rollback to 0 %
  (KServe then routes everything to the previous ready revision).

The registry model is pinned to one version at deploy time (``models:/gem-ranker/7``, not the alias), so a
restart never picks up a different champion silently. ``<ws>/serving/deploy.json`` records what is live and
what it replaced; ``rollback-deploy`` uses it. Exit codes: 0 ok, 1 smoke test / rollback failed, 2 bad input.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import typer

from gemflow.commands.common import WorkspaceOpt, workspace

MODEL_NAME = "gem-ranker"
CHAMPION_URI = f"models:/{MODEL_NAME}@champion"
FAILED_EXIT, BAD_INPUT_EXIT = 1, 2
ModeOpt = Annotated[
    str, typer.Option("--mode", help="local (a background gemflow serve) or cluster (kubectl).")
]
KubectlOpt = Annotated[str, typer.Option("--kubectl", help="kubectl binary (cluster mode).")]


class DeployError(RuntimeError):
    """A deploy step failed; the message says which and why."""


@dataclass
class Deployment:
    mode: str
    model_uri: str  # pinned: models:/gem-ranker/7 or a model.pt path
    version: str  # what the server reports serving ("gem-ranker/7")
    url: str
    status: str  # deployed | promoted | rolled_back
    pid: int = 0
    manifest: str = ""
    previous_uri: str = ""  # the promoted deployment this one replaced ("" = none)
    previous_version: str = ""
    at: str = ""


# ----------------------------------------------------------------------------------------------- state
def serving_dir(ws) -> Path:
    return ws.root / "serving"


def read_state(ws) -> Deployment | None:
    path = serving_dir(ws) / "deploy.json"
    return Deployment(**json.loads(path.read_text())) if path.exists() else None


def write_state(ws, dep: Deployment) -> None:
    dep.at = dt.datetime.now(dt.UTC).isoformat()
    path = serving_dir(ws) / "deploy.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(dep), indent=2))
    tmp.replace(path)


def pin(model_uri: str, tracking_uri: str, ws) -> str:
    """``models:/name@alias`` -> ``models:/name/<its version now>``; anything else unchanged."""
    from models.embeddings.refresh import MODEL_URI, mlflow_client

    match = MODEL_URI.match(model_uri)
    if not match or not match["alias"]:
        return model_uri
    from mlflow.exceptions import MlflowException

    try:
        mv = mlflow_client(tracking_uri, ws).get_model_version_by_alias(match["name"], match["alias"])
    except MlflowException as err:
        raise DeployError(f"cannot resolve {model_uri}: {err.message}") from err
    return f"models:/{match['name']}/{mv.version}"


# ----------------------------------------------------------------------------------------------- local mode
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    status = Path(f"/proc/{pid}/status")  # a zombie (exited, not yet reaped by its parent) is not alive
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def _is_our_server(pid: int) -> bool:
    cmdline = Path(f"/proc/{pid}/cmdline")
    return cmdline.exists() and b"serve" in cmdline.read_bytes() and _alive(pid)


def stop_local(ws, timeout: float = 30.0) -> bool:
    """Stop the background server named by the pid file (only if it still is our server)."""
    pid_file = serving_dir(ws) / "server.pid"
    if not pid_file.exists():
        return False
    pid = int(pid_file.read_text())
    stopped = False
    if _is_our_server(pid):
        os.killpg(pid, signal.SIGTERM)  # its own session: the server and anything it spawned
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
        stopped = True
    pid_file.unlink()
    return stopped


def ready_detail(url: str) -> dict | None:
    from serving.client import get

    try:
        status, body = get(f"{url}/v2/models/{MODEL_NAME}/ready", timeout=2.0)
    except OSError:
        return None
    return body if status == 200 and body.get("ready") else None


def start_local(ws, model_uri: str, port: int, tracking_uri: str, timeout: float) -> tuple[int, str, str]:
    """Start ``gemflow serve`` in the background; wait until the model is ready. Returns (pid, url, version)."""
    out = serving_dir(ws)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(Path(sys.executable).with_name("gemflow")), "serve", "--workspace", str(ws.root),
           "--http-port", str(port), "--model-uri", model_uri]  # fmt: skip
    if tracking_uri:
        cmd += ["--set", f"tracking_uri={tracking_uri}"]
    log_path = out / "server.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (out / "server.pid").write_text(str(proc.pid))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise DeployError(f"gemflow serve exited with {proc.returncode}; log tail:\n{tail}")
        detail = ready_detail(url)
        if detail:
            return proc.pid, url, str(detail.get("model_version"))
        time.sleep(0.5)
    stop_local(ws)
    raise DeployError(f"the server on {url} was not ready within {timeout:.0f}s; see {log_path}")


# ----------------------------------------------------------------------------------------------- cluster mode
def render_manifest(ws, model_uri: str, overrides: list[str] | None) -> tuple[Path, dict]:
    import yaml

    from gemflow.commands.common import config
    from serving.config import ServingConfig
    from serving.manifest import render

    cfg = config(ServingConfig, None, overrides, model_uri=model_uri)
    manifest = render(cfg)
    # the canary revision gets its own "latest-" URL so the smoke test reaches it and only it
    manifest["metadata"]["annotations"]["serving.kserve.io/enable-tag-routing"] = "true"
    path = serving_dir(ws) / "inferenceservice.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return path, manifest


def kubectl(binary: str, *args: str, timeout: float = 660) -> str:
    try:
        proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as err:
        raise DeployError(f"{binary!r} not found: cluster mode needs kubectl in the stage image") from err
    if proc.returncode:
        raise DeployError(
            f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}"
        )
    return proc.stdout


def canary_patch(percent: int) -> str:
    return json.dumps({"spec": {"predictor": {"canaryTrafficPercent": percent}}})


def cluster_url(binary: str, name: str, namespace: str) -> str:
    """The canary ("latest" tag) URL of the InferenceService, else its main URL."""
    path = '{.status.components.predictor.traffic[?(@.tag=="latest")].url}'
    url = kubectl(binary, "get", "inferenceservice", name, "-n", namespace, "-o", f"jsonpath={path}").strip()
    return url or kubectl(
        binary, "get", "inferenceservice", name, "-n", namespace, "-o", "jsonpath={.status.url}"
    )


# ----------------------------------------------------------------------------------------------- smoke test
def smoke_test(ws, url: str, expected_version: str, users: int = 3, candidates: int = 20) -> list[str]:
    """Rank real candidates for a few users with the live server; returns the problems found (empty = pass)."""
    import numpy as np

    from features.feature_repo.offline import partition_days, read_partition
    from models.embeddings.versions import sample_users
    from serving.client import rank

    days = partition_days(ws, "offline", "ad_attributes")
    if not days:
        return [f"no ads to rank: {ws.offline('ad_attributes')} is empty"]
    ads = np.sort(read_partition(ws.offline("ad_attributes", days[-1]), ["ad_id"]).column(0).to_numpy())
    ads = [int(a) for a in ads[:candidates]]
    ids = [int(u) for u in sample_users(ws, users)] or [0]
    problems = []
    for user in ids:
        try:
            status, body = rank(url, MODEL_NAME, user, ads)
        except OSError as err:
            return [f"no server answering at {url}: {err}"]
        if status != 200:
            problems.append(f"user {user}: HTTP {status}: {body.get('error', body)}")
            continue
        p = np.asarray(body["p_click"], np.float64)
        if sorted(body["ad_ids"]) != sorted(ads):
            problems.append(f"user {user}: ranked {len(body['ad_ids'])} ads, sent {len(ads)}")
        if not (np.isfinite(p).all() and ((p >= 0) & (p <= 1)).all()):
            problems.append(f"user {user}: p_click outside [0, 1] or not finite")
        elif (np.diff(p) > 1e-9).any():
            problems.append(f"user {user}: ads not sorted by p_click")
        if expected_version and body.get("model_version") != expected_version:
            problems.append(f"user {user}: served {body.get('model_version')}, deployed {expected_version}")
        if body.get("fallback", {}).get("embedding_version_mismatch"):
            problems.append(
                f"user {user}: embedding {body.get('embedding_version')} is not from the user model the ranker "
                f"expects ({body.get('expected_user_model_version')})"
            )
    return problems


# ----------------------------------------------------------------------------------------------- commands
def _fail(err: Exception, code: int = BAD_INPUT_EXIT) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(code=code)


def _check_mode(mode: str) -> None:
    if mode not in ("local", "cluster"):
        raise _fail(ValueError(f"--mode must be local or cluster, got {mode!r}"))


def register(app: typer.Typer) -> None:
    @app.command("deploy")
    def deploy_cmd(
        mode: ModeOpt = "local",
        model_uri: Annotated[
            str, typer.Option(help="Ranker: a models:/ URI or a model.pt path.")
        ] = CHAMPION_URI,
        port: Annotated[int, typer.Option(help="Local mode: HTTP port.")] = 8080,
        tracking_uri: Annotated[str, typer.Option(help="MLflow tracking URI.")] = "",
        overrides: Annotated[
            list[str] | None,
            typer.Option("--set", "-s", help="Serving config override key=value (repeatable)."),
        ] = None,
        kubectl_bin: KubectlOpt = "kubectl",
        timeout: Annotated[float, typer.Option(help="Seconds to wait for the model to be ready.")] = 300.0,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Render the InferenceService and roll the ranker out (local: restart the background server)."""
        _check_mode(mode)
        w = workspace(ws)
        try:
            pinned = pin(model_uri, tracking_uri, w)
            manifest_path, manifest = render_manifest(w, pinned, overrides)
            live = read_state(w)
            previous = live if live and live.status == "promoted" else None
            if mode == "local":
                running = live and live.model_uri == pinned and live.url.endswith(f":{port}")
                if running and _is_our_server(live.pid) and ready_detail(live.url):
                    typer.echo(f"{live.version} is already live at {live.url}: unchanged")
                    return
                stop_local(w)
                pid, url, version = start_local(w, pinned, port, tracking_uri, timeout)
            else:
                meta = manifest["metadata"]
                kubectl(kubectl_bin, "apply", "-f", str(manifest_path))
                kubectl(kubectl_bin, "wait", "--for=condition=Ready", f"inferenceservice/{meta['name']}",
                        "-n", meta["namespace"], f"--timeout={int(timeout)}s")  # fmt: skip
                pid, url, version = 0, cluster_url(kubectl_bin, meta["name"], meta["namespace"]), pinned
        except DeployError as err:
            raise _fail(err, FAILED_EXIT) from err
        dep = Deployment(mode, pinned, version, url, "deployed", pid, str(manifest_path))
        if previous and previous.model_uri != pinned:
            dep.previous_uri, dep.previous_version = previous.model_uri, previous.version
        elif live:
            dep.previous_uri, dep.previous_version = live.previous_uri, live.previous_version
        write_state(w, dep)
        typer.echo(json.dumps(asdict(dep), indent=2))

    @app.command("smoke-test")
    def smoke_cmd(
        url: Annotated[str, typer.Option(help="Server base URL; default: the current deployment's.")] = "",
        users: Annotated[int, typer.Option(help="Users to rank for (sampled from the latest refresh).")] = 3,
        candidates: Annotated[int, typer.Option(help="Candidate ads per request.")] = 20,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Rank real candidates through the deployed server; exit 1 on any bad answer."""
        w = workspace(ws)
        dep = read_state(w)
        if not url and dep is None:
            raise _fail(
                ValueError("nothing deployed (no serving/deploy.json): pass --url or run `gemflow deploy`")
            )
        problems = smoke_test(w, url or dep.url, dep.version if dep else "", users, candidates)
        if problems:
            typer.echo("smoke test FAILED:\n  " + "\n  ".join(problems), err=True)
            raise typer.Exit(code=FAILED_EXIT)
        typer.echo(f"smoke test passed: {url or dep.url} ({dep.version if dep else 'unknown version'})")

    @app.command("promote")
    def promote_cmd(
        mode: ModeOpt = "local", kubectl_bin: KubectlOpt = "kubectl", ws: WorkspaceOpt = None
    ) -> None:
        """Send all traffic to the deployed version (cluster: canary -> 100 %) and record it as live."""
        _check_mode(mode)
        w = workspace(ws)
        dep = read_state(w)
        if dep is None:
            raise _fail(ValueError("nothing deployed to promote (no serving/deploy.json)"))
        if mode == "cluster":
            meta = _manifest_meta(dep)
            try:
                kubectl(kubectl_bin, "patch", "inferenceservice", meta["name"], "-n", meta["namespace"],
                        "--type", "merge", "-p", canary_patch(100))  # fmt: skip
            except DeployError as err:
                raise _fail(err, FAILED_EXIT) from err
        dep.status = "promoted"
        write_state(w, dep)
        typer.echo(f"{dep.version} promoted ({mode})")

    @app.command("rollback-deploy")
    def rollback_cmd(
        mode: ModeOpt = "local",
        port: Annotated[int, typer.Option(help="Local mode: HTTP port.")] = 8080,
        tracking_uri: Annotated[str, typer.Option(help="MLflow tracking URI.")] = "",
        kubectl_bin: KubectlOpt = "kubectl",
        timeout: Annotated[float, typer.Option(help="Seconds to wait for the model to be ready.")] = 300.0,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Undo a failed rollout: @champion back to the version it replaced, and the previous deployment back."""
        _check_mode(mode)
        w = workspace(ws)
        dep = read_state(w)
        if dep is None:
            raise _fail(ValueError("nothing deployed to roll back (no serving/deploy.json)"))
        try:
            target = _registry_rollback(dep, tracking_uri, w) or dep.previous_uri
            if not target:
                raise DeployError(f"{dep.version} replaced no earlier deployment: nothing to roll back to")
            if mode == "local":
                stop_local(w)
                pid, url, version = start_local(w, target, port, tracking_uri, timeout)
            else:
                meta = _manifest_meta(dep)
                kubectl(kubectl_bin, "patch", "inferenceservice", meta["name"], "-n", meta["namespace"],
                        "--type", "merge", "-p", canary_patch(0))  # fmt: skip
                pid, url, version = 0, dep.url, target
        except DeployError as err:
            raise _fail(err, FAILED_EXIT) from err
        write_state(w, Deployment(mode, target, version, url, "promoted", pid, dep.manifest))
        typer.echo(f"rolled back {dep.version} -> {version} ({mode})")

    @app.command("undeploy")
    def undeploy_cmd(ws: WorkspaceOpt = None) -> None:
        """Stop the local background server."""
        w = workspace(ws)
        typer.echo("stopped" if stop_local(w) else "no local server running")


def _manifest_meta(dep: Deployment) -> dict:
    import yaml

    return yaml.safe_load(Path(dep.manifest).read_text())["metadata"]


def _registry_rollback(dep: Deployment, tracking_uri: str, ws) -> str:
    """If the failed version is the registry's @champion, move the alias back (``gemflow rollback``)."""
    from models.embeddings.refresh import MODEL_URI, mlflow_client

    match = MODEL_URI.match(dep.model_uri)
    if not match or not match["version"]:
        return ""
    from mlflow.exceptions import MlflowException

    from models.registry import champion_version, rollback

    client = mlflow_client(tracking_uri, ws)
    if champion_version(client, match["name"]) != match["version"]:
        return ""
    try:
        return f"models:/{match['name']}/{rollback(match['name'], client)}"
    except (ValueError, MlflowException):
        return ""  # no earlier champion: fall back to the previous deployment, if any
