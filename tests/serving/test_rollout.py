"""The rollout protocol (``serving.rollout``): one version string for deployer and server, and the cluster path
driven end to end by the real CLI steps against a fake ``kubectl`` (tests/serving/fake_kubectl.py: it records
every call and answers like the API server; the revisions it routes to are real ``gemflow serve`` processes).
A good canary is promoted; a bad one (a ranker trained against another user model's embeddings) fails its smoke
test and is rolled back to the good revision."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving.rollout.base import RolloutError
from serving.rollout.version import served_version

REPO = Path(__file__).resolve().parents[2]
FAKE_KUBECTL = Path(__file__).with_name("fake_kubectl.py")


def test_the_deployer_expects_the_version_label_the_server_reports():
    from serving.model_source import _registry_version

    pinned = "models:/gem-ranker/7"
    assert served_version(pinned) == _registry_version(pinned) == "gem-ranker/7"  # not "models:/gem-ranker/7"
    with pytest.raises(RolloutError, match="pin it first"):
        served_version("models:/gem-ranker@champion")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(ws_root: Path, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """A real ranker server for one model: what the kubelet would run for a revision of it."""
    port = _free_port()
    cmd = [str(Path(sys.executable).with_name("gemflow")), "serve", "--workspace", str(ws_root),
           "--http-port", str(port), "--model-uri", str(model)]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    from serving.rollout.local import ready_detail

    deadline = time.monotonic() + timeout
    while not ready_detail(url):
        assert proc.poll() is None and time.monotonic() < deadline, f"the server for {url} did not come up"
        time.sleep(0.5)


def _gemflow(ws_root: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("gemflow")), *args, "--workspace", str(ws_root)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    print(f"$ gemflow {' '.join(args)}  -> exit {proc.returncode}\n{proc.stdout}{proc.stderr}")
    return proc


@pytest.mark.integration  # a Feast world, an embedding refresh and two real model servers
def test_cluster_rollout_promotes_a_good_canary_and_rolls_back_a_bad_one(tmp_path):
    from typer.testing import CliRunner

    from gemflow.cli import app
    from tests.dags.test_pipeline_dags import _pipeline_world

    ws, user_model, rankers = _pipeline_world(tmp_path)
    refreshed = CliRunner().invoke(
        app, ["refresh-embeddings", "--model-uri", str(user_model), "--nproc", "1", "-w", str(ws.root)]
    )
    assert refreshed.exit_code == 0, refreshed.output

    state = tmp_path / "kube"
    state.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_KUBECTL} "$@"\n')
    kubectl.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_KUBECTL_STATE": str(state),
    }

    pods = {name: _serve(ws.root, path, tmp_path / f"{name}.log") for name, path in rankers.items()}
    try:
        for proc, url in pods.values():
            _wait_ready(url, proc)
        (state / "pods.json").write_text(json.dumps({str(rankers[n]): url for n, (_, url) in pods.items()}))
        cluster = ("--mode", "cluster")

        # a good canary: deployed, smoke-tested through its own URL, promoted
        assert _gemflow(ws.root, env, "deploy", *cluster, "--model-uri", str(rankers["good"])).returncode == 0
        assert _gemflow(ws.root, env, "smoke-test").returncode == 0
        assert _gemflow(ws.root, env, "promote", *cluster).returncode == 0
        live = json.loads((ws.root / "serving" / "deploy.json").read_text())
        assert (live["version"], live["status"], live["url"]) == ("good", "promoted", pods["good"][1])

        # a bad canary: its smoke test fails (embeddings of another user model), the rollback restores good
        assert (
            _gemflow(ws.root, env, "deploy", *cluster, "--model-uri", str(rankers["stale"])).returncode == 0
        )
        canary = json.loads((ws.root / "serving" / "deploy.json").read_text())
        assert canary["url"] == pods["stale"][1] and canary["previous_version"] == "good"
        smoke = _gemflow(ws.root, env, "smoke-test")
        assert smoke.returncode == 1 and "is not from the user model the ranker expects" in smoke.stderr
        rolled = _gemflow(ws.root, env, "rollback-deploy", *cluster)
        assert rolled.returncode == 0 and "rolled back stale -> good (cluster)" in rolled.stdout
    finally:
        for proc, _ in pods.values():
            proc.terminate()
            proc.wait(timeout=60)

    live = json.loads((ws.root / "serving" / "deploy.json").read_text())
    assert (live["model_uri"], live["version"], live["status"]) == (str(rankers["good"]), "good", "promoted")
    assert live["url"] == pods["good"][1]  # the route now sends everything to the good revision
    isvc = json.loads((state / "objects.json").read_text())["gemflow/gem-ranker"]
    revisions = [r["model_uri"] for r in isvc["revisions"]]
    assert revisions == [str(rankers["good"]), str(rankers["stale"])]
    assert (isvc["latest_percent"], revisions[isvc["stable"]]) == (
        0,
        str(rankers["good"]),
    )  # all traffic: good

    calls = [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]
    verbs = [c[0] if c[0] != "patch" else f"patch {c[-1]}" for c in calls]
    print("kubectl calls:\n  " + "\n  ".join(" ".join(c) for c in calls))
    canary_at = '{"spec": {"predictor": {"canaryTrafficPercent": %d}}}'
    assert verbs == ["apply", "wait", "get", f"patch {canary_at % 100}",
                     "apply", "wait", "get", f"patch {canary_at % 0}", "get"]  # fmt: skip


@pytest.mark.integration  # helm
def test_the_deployer_applies_the_charts_manifest_and_the_chart_creates_no_inference_service(tmp_path):
    """One owner: the release holds the ranker's manifest as data, the deploy stage applies it with the model
    pinned (keeping the chart's hardening, secrets and canary)."""
    import yaml

    from serving.rollout.isvc import inference_service
    from tests.helm.render import HelmMissing, copy_without_airflow, render

    try:
        docs = render(copy_without_airflow(tmp_path), "values-production.yaml")
    except HelmMissing as err:
        pytest.skip(str(err))
    assert not [d for d in docs if d["kind"] == "InferenceService"]
    (shipped,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("ranker-manifest")
    ]
    chart_file = tmp_path / "inferenceservice.yaml"
    chart_file.write_text(shipped["data"]["inferenceservice.yaml"])
    chart = yaml.safe_load(chart_file.read_text())

    applied = inference_service("models:/gem-ranker/7", [], str(chart_file))
    args = applied["spec"]["predictor"]["containers"][0]["args"]
    assert "--set=model_uri=models:/gem-ranker/7" in args and not any("@champion" in a for a in args)
    assert [a for a in args if "model_uri" not in a] == [
        a for a in chart["spec"]["predictor"]["containers"][0]["args"] if "model_uri" not in a
    ]
    assert applied["spec"]["predictor"]["canaryTrafficPercent"] == 10  # the production values' canary
    assert applied["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "gemflow-deploy"
    assert applied["metadata"]["annotations"]["serving.kserve.io/enable-tag-routing"] == "true"
    assert applied["metadata"]["namespace"]
    container = applied["spec"]["predictor"]["containers"][0]
    assert container["securityContext"] == chart["spec"]["predictor"]["containers"][0]["securityContext"]
