"""The chart's authenticated MLflow, run for real on 127.0.0.1: the server as the rendered Deployment starts it
(its `--app-name`, the environment from its Secrets, the basic_auth.ini of its ConfigMap), and a client with only
the two variables every MLflow client pod gets (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD).

No Postgres here: the backend store and the auth store share one SQLite file instead, as they share the `mlflow`
database on a cluster. The Secrets are a dict of made-up values that the test resolves each secretKeyRef from.
"""

from __future__ import annotations

import base64
import configparser
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helm.render import HelmMissing, copy_without_airflow, render
from tests.ports import free_port

pytestmark = pytest.mark.integration

SECRETS = {  # (Secret, key) -> value: what `kubectl create secret` would hold (docs/cluster.md)
    ("gemflow-mlflow-auth", "username"): "gemflow-admin",
    ("gemflow-mlflow-auth", "password"): "a-long-test-password-1",
    ("gemflow-mlflow-auth", "flask-secret-key"): "0123456789abcdef",
}
PASSED_THROUGH = (
    "MLFLOW_",
)  # server variables taken from the chart as they are; Postgres/S3 ones are not used


def _resolve(env: list[dict]) -> dict[str, str]:
    out = {}
    for e in env:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            if (ref["name"], ref["key"]) in SECRETS:
                out[e["name"]] = SECRETS[ref["name"], ref["key"]]
        else:
            out[e["name"]] = e["value"]
    return out


@pytest.fixture(scope="module")
def chart(tmp_path_factory):
    try:
        docs = render(copy_without_airflow(tmp_path_factory.mktemp("chart")), "values-trial.yaml")
    except HelmMissing as err:
        pytest.skip(str(err))
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gemflow-mlflow"]
    (server,) = dep["spec"]["template"]["spec"]["containers"]
    ini = next(d for d in docs if d["metadata"]["name"] == "gemflow-mlflow-auth")["data"]["basic_auth.ini"]
    stage = next(d for d in docs if d["metadata"]["name"] == "gemflow-stage-settings")["data"]
    (client,) = yaml.safe_load(stage["pod-template.yaml"])["spec"]["containers"]
    return server, ini, client


@pytest.fixture(scope="module")
def server(chart, tmp_path_factory):
    """`mlflow server` with the chart's app, auth config and Secret-backed environment; the base URL."""
    container, ini_text, _ = chart
    root = tmp_path_factory.mktemp("mlflow-auth")
    db = f"sqlite:///{root / 'mlflow.db'}"
    ini = configparser.ConfigParser()
    ini.read_string(ini_text)
    assert ini["mlflow"]["database_uri"].startswith("postgresql+psycopg://")
    ini["mlflow"]["database_uri"] = db  # the backend store's database, as on the cluster
    env = {k: v for k, v in _resolve(container["env"]).items() if k.startswith(PASSED_THROUGH)}
    config_path = root / Path(env["MLFLOW_AUTH_CONFIG_PATH"]).name
    with open(config_path, "w") as f:
        ini.write(f)
    env["MLFLOW_AUTH_CONFIG_PATH"] = str(config_path)
    assert {
        "MLFLOW_AUTH_ADMIN_USERNAME",
        "MLFLOW_AUTH_ADMIN_PASSWORD",
        "MLFLOW_FLASK_SERVER_SECRET_KEY",
    } <= set(env)
    app = [a for a in container["args"] if a.startswith(("--app-name", "--workers"))]
    assert "--app-name=basic-auth" in app
    port = free_port()
    mlflow_bin = str(Path(sys.executable).with_name("mlflow"))
    cmd = [mlflow_bin, container["args"][0], *app, "--host=127.0.0.1", f"--port={port}",
           f"--backend-store-uri={db}", "--serve-artifacts", f"--artifacts-destination={root / 'artifacts'}",
           f"--allowed-hosts=127.0.0.1:{port}"]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    log = open(root / "server.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, env={**clean, **env}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    probe = container["readinessProbe"]["httpGet"]["path"]
    try:
        deadline = time.monotonic() + 90
        while True:  # the chart's readiness probe, without a login
            assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}{probe}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (
                "no /health within 90 s:\n" + (root / "server.log").read_text()
            )
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _status(url: str, auth: tuple[str, str] | None = None) -> int:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_server_wants_a_login_except_on_health(server):
    search = f"{server}/api/2.0/mlflow/experiments/search?max_results=1"
    assert _status(f"{server}/health") == 200
    assert _status(search) == 401
    assert _status(search, ("gemflow-admin", "wrong-password-123")) == 401
    assert _status(search, ("gemflow-admin", SECRETS["gemflow-mlflow-auth", "password"])) == 200


def test_a_client_pod_logs_a_run_with_the_login_from_its_environment(server, chart, tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    _, _, pod = chart
    env = _resolve(pod["env"])
    login = {k: env[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    assert login == {
        "MLFLOW_TRACKING_USERNAME": "gemflow-admin",
        "MLFLOW_TRACKING_PASSWORD": SECRETS["gemflow-mlflow-auth", "password"],
    }
    for name, value in login.items():
        monkeypatch.setenv(name, value)
    client = MlflowClient(tracking_uri=server)
    experiment = client.create_experiment("auth-check")
    run = client.create_run(experiment)
    client.log_metric(run.info.run_id, "valid_ne", 0.9, step=1)
    plot = tmp_path / "learning_curve.png"
    plot.write_bytes(b"\x89PNG\r\n\x1a\n")
    client.log_artifact(
        run.info.run_id, str(plot)
    )  # through the server's artifact proxy, also behind the login
    client.set_terminated(run.info.run_id)
    assert client.get_run(run.info.run_id).data.metrics == {"valid_ne": 0.9}
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["learning_curve.png"]
    back = client.download_artifacts(run.info.run_id, "learning_curve.png", str(tmp_path / "back"))
    assert Path(back).read_bytes() == plot.read_bytes()
    client.create_registered_model("gem-auth-check")  # the registry is behind the same login

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong-password-123")
    with pytest.raises(MlflowException, match="401"):
        MlflowClient(tracking_uri=server).get_run(run.info.run_id)
