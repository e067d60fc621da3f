"""Airflow's public REST API (v2), as the platform's ``gemflow wait`` and the tests read it: DAG runs, task
instances, asset events; and ``wait_for_run``, which follows the runs until one DAG succeeds."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from pathlib import Path


class AirflowRunFailed(RuntimeError):
    """A DAG run failed, or the awaited DAG had no successful run in time."""


class AirflowApi:
    """Airflow's public REST API as the embedded simple auth manager's ``admin`` (its generated password)."""

    def __init__(self, base: str, passwords: Path, user: str = "admin"):
        self.base, self.token = base, ""
        body = json.dumps({"username": user, "password": json.loads(passwords.read_text())[user]}).encode()
        self.token = self.call("POST", "/auth/token", body)["access_token"]

    def call(self, method: str, path: str, data: bytes | None = None) -> dict:
        req = urllib.request.Request(f"{self.base}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def runs(self, dag_id: str = "~") -> list[dict]:
        return self.call("GET", f"/api/v2/dags/{dag_id}/dagRuns?limit=500&order_by=start_date")["dag_runs"]

    def tasks(self, dag_id: str, run_id: str) -> dict[str, dict]:
        path = f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances"
        return {t["task_id"]: t for t in self.call("GET", path)["task_instances"]}

    def events(self, asset_name: str) -> list[dict]:
        assets = self.call("GET", f"/api/v2/assets?name_pattern={urllib.parse.quote(asset_name)}")["assets"]
        asset = next((a for a in assets if a["name"] == asset_name), None)
        if asset is None:
            return []
        return self.call("GET", f"/api/v2/assets/events?asset_id={asset['id']}&limit=100")["asset_events"]


def wait_for_run(api: AirflowApi, dag_id: str, timeout: float, echo=print, poll: float = 15.0) -> dict:
    """Block until ``dag_id`` has a successful run; echo each run that finishes meanwhile; fail on a failed
    run of any DAG (with its id and note)."""
    seen = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in api.runs():
            key = (r["dag_id"], r["dag_run_id"], r["state"])
            if r["state"] in ("success", "failed") and key not in seen:
                seen.add(key)
                note = f"  ({r['note']})" if r.get("note") else ""
                echo(f"{r['end_date'][11:19]}  {r['dag_id']:<17} {r['state']:<8} {r['dag_run_id']}{note}")
            if r["state"] == "failed":
                raise AirflowRunFailed(f"{r['dag_id']} run {r['dag_run_id']} failed; see the Airflow UI")
            if r["dag_id"] == dag_id and r["state"] == "success":
                return r
        time.sleep(poll)
    raise AirflowRunFailed(f"no successful {dag_id} run within {timeout:.0f}s")
