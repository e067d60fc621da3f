"""Faults on the live platform (issue 15, point 6), run against a platform that has completed one pass.

- ``scheduler``: a forced user-model training is started, the scheduler is SIGKILLed while the training task
  runs, then started again (``gemflow restart airflow-scheduler``): the run must end successful, and the model
  its event names must be registered exactly once.
- ``endpoint``: the model server is SIGKILLed; a ``gemflow_deploy`` run must bring the endpoint back with the
  same version.
- ``mlflow``: the MLflow server is SIGKILLed while a registration runs; the registration must end successful or
  fail clearly, and the server comes back with ``gemflow restart mlflow``.

    .venv/bin/python -m tests.platform.faults -w WORKSPACE [scheduler endpoint mlflow]

Each case prints what the platform did; a case whose expectation fails raises ``AssertionError``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.parse
from pathlib import Path

from gemflow.platform import Platform
from gemflow.probes import http_ok as _http_ok
from gemflow.workspace import Workspace

POLL = 5.0


def _trigger(api, dag_id: str, conf: dict, note: str) -> str:
    body = json.dumps({"logical_date": None, "conf": conf, "note": note}).encode()
    return api.call("POST", f"/api/v2/dags/{dag_id}/dagRuns", body)["dag_run_id"]


def _run(api, dag_id: str, run_id: str) -> dict:
    return api.call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}")


def _wait_run(platform: Platform, dag_id: str, run_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            run = _run(platform.api(), dag_id, run_id)
        except OSError:  # the API server is busy: ask again
            time.sleep(POLL)
            continue
        if run["state"] in ("success", "failed"):
            return run
        time.sleep(POLL)
    raise AssertionError(f"{dag_id} {run_id} did not finish within {timeout:.0f}s")


def _wait_task(platform: Platform, dag_id: str, run_id: str, task_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if platform.api().tasks(dag_id, run_id).get(task_id, {}).get("state") == "running":
            return
        time.sleep(POLL)
    raise AssertionError(f"{dag_id}.{task_id} did not start within {timeout:.0f}s")


def _service_pid(platform: Platform, name: str) -> int:
    return next(s.pid for s in platform.running() if s.name == name)


def _versions(platform: Platform, model: str) -> list:
    from models.tracking.mlflow_store import connect

    return list(connect(platform.ws).search_model_versions(f"name='{model}'"))


def scheduler_killed_mid_training(platform: Platform, timeout: float = 1800) -> str:
    api = platform.api()
    before = len(_versions(platform, "gem-user-model"))
    run_id = _trigger(
        api, "gemflow_train", {"force": True}, "fault case: the scheduler is killed mid-training"
    )
    _wait_task(platform, "gemflow_train", run_id, "train_user_model", timeout)
    time.sleep(20)  # into the training
    pid = _service_pid(platform, "airflow-scheduler")
    os.kill(pid, signal.SIGKILL)
    time.sleep(5)
    platform.restart("airflow-scheduler")
    run = _wait_run(platform, "gemflow_train", run_id, timeout)
    tries = platform.api().tasks("gemflow_train", run_id)["train_user_model"]["try_number"]
    assert run["state"] == "success", f"the training run ended {run['state']} after the scheduler was killed"
    # the register DAG that its USER_MODEL event triggers registers that run once
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(_versions(platform, "gem-user-model")) == before:
        time.sleep(POLL)
    time.sleep(30)  # a duplicate registration would show up by now
    after = _versions(platform, "gem-user-model")
    run_dirs = [v.source for v in after]
    assert len(after) == before + 1, f"{len(after) - before} new versions for one training: {run_dirs}"
    return f"scheduler killed (pid {pid}) mid-training: run {run['state']} (train task try {tries}); 1 new version"


def endpoint_killed(platform: Platform, timeout: float = 900) -> str:
    pid_file = platform.ws.root / "serving" / "server.pid"
    pid = int(pid_file.read_text())
    deployed = json.loads((platform.ws.root / "serving" / "deploy.json").read_text())
    os.killpg(pid, signal.SIGKILL)
    time.sleep(2)
    url = deployed.get("url") or platform.endpoint_url
    assert _http_ok(f"{url}/v2/health/live") is None, "the endpoint still answers after SIGKILL"
    run_id = _trigger(platform.api(), "gemflow_deploy", {}, "fault case: the model server was killed")
    run = _wait_run(platform, "gemflow_deploy", run_id, timeout)
    tasks = platform.api().tasks("gemflow_deploy", run_id)
    ready = _http_ok(f"{url}/v2/models/gem-ranker/ready")
    assert run["state"] == "success" and ready and ready.get("ready"), (run["state"], tasks, ready)
    return (
        f"endpoint killed (pid {pid}): gemflow_deploy {run['state']}, serving {ready['model_version']} again"
    )


def mlflow_killed_during_registration(platform: Platform, timeout: float = 900) -> str:
    api = platform.api()
    run_id = _trigger(
        api, "gemflow_register", {"kind": "ranker"}, "fault case: MLflow killed mid-registration"
    )
    _wait_task(platform, "gemflow_register", run_id, "register_and_gate", timeout)
    pid = _service_pid(platform, "mlflow")
    os.killpg(pid, signal.SIGKILL)
    run = _wait_run(platform, "gemflow_register", run_id, timeout)
    task = platform.api().tasks("gemflow_register", run_id)["register_and_gate"]
    platform.restart("mlflow")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _http_ok(f"{platform.mlflow_url}/health") is None:
        time.sleep(POLL)
    assert _http_ok(f"{platform.mlflow_url}/health") is not None, "the MLflow server did not come back"
    return (f"MLflow server killed (pid {pid}) during registration: register run {run['state']}, task "
            f"{task['state']} (try {task['try_number']}); MLflow restarted and answers /health")  # fmt: skip


CASES = {
    "scheduler": scheduler_killed_mid_training,
    "endpoint": endpoint_killed,
    "mlflow": mlflow_killed_during_registration,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-w", "--workspace", type=Path, required=True)
    parser.add_argument("cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    platform = Platform(Workspace(args.workspace))
    from gemflow.platform_env import PlatformConfig

    platform.cfg = PlatformConfig(**platform.read_state()["config"])
    for name in args.cases:
        t0 = time.monotonic()
        print(f"{name}: {CASES[name](platform)} ({time.monotonic() - t0:.0f}s)", flush=True)  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
