"""``gemflow up`` / ``gemflow down``: the embedded platform as long-running local processes.

``up`` starts, on the workspace's embedded defaults:

- the MLflow tracking server with its UI (SQLite backend and artifacts under ``<ws>/mlflow``);
- the Airflow 3 components one machine runs (from ``.venv-airflow``, whose ``bin`` is put first on ``PATH``:
  Airflow starts its helpers by the bare name ``airflow``): the API server with the UI, the scheduler
  (``LocalExecutor``), the DAG processor and the triggerer, all on ``<ws>/airflow`` (SQLite metadata DB);
- the ranker endpoint (``gemflow deploy --mode local``) when the registry already holds a ranker ``@champion``;
  otherwise the deploy DAG starts it once the pipeline has promoted one;
- the live event collector (``gemflow events serve`` on ``events_port``, ``serving.events``) unless
  ``start_events`` is off: the ad server's impressions, clicks and conversions reach the ranker's online lists
  within a second and the raw log exactly once.

Every service binds ``127.0.0.1`` (``host``); each port is checked free before anything starts. Airflow's log
servers (8793/8794 by default) are not started at all (``--skip-serve-logs``): they bind every interface and only
serve logs to other machines, while here the API server reads the task logs from ``<ws>/airflow/logs`` directly.
The Airflow API port moves ``AIRFLOW__API__BASE_URL`` and the execution API URL with it.

Each service runs in its own session (process group); ``up`` records the pid, the process group and the start
time of each in ``<ws>/platform/state.json`` and gives every process it starts one marker variable
(``GEMFLOW_PLATFORM_ID``) that all their descendants inherit. ``down`` stops the recorded process groups (TERM,
then KILL after a grace period), then every process still carrying the marker: task processes, training ranks
and the model server started by a deploy task leave their parent's group, but not its environment. Logs of each
service are in ``<ws>/platform/logs/``.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import time
import uuid
from dataclasses import asdict

from gemflow import running_ui
from gemflow.airflow_api import AirflowApi, AirflowRunFailed, wait_for_run
from gemflow.platform_env import PlatformConfig, PlatformLayout
from gemflow.probes import champion_version, http_ok, port_free
from gemflow.processes import start_ticks, stop_group
from gemflow.services import PlatformError, Service, alive, spawn, stop_services, wait_ready


class Platform(PlatformLayout):
    """The platform's lifecycle on one workspace: start its services, restart one, stop them all."""

    def api(self) -> AirflowApi:
        state = self.read_state()
        if state is None:
            raise PlatformError(f"the platform is not running from {self.ws.root} (no {self.state_file})")
        port = state["config"]["airflow_port"]
        host = state["config"]["host"]
        return AirflowApi(
            f"http://{host}:{port}", self.airflow_home / "simple_auth_manager_passwords.json.generated"
        )

    def wait_for(self, dag_id: str, timeout: float, echo=print, poll: float = 15.0) -> dict:
        """Block until ``dag_id`` has a successful run; echo each run that finishes meanwhile; fail on a failed
        run of any DAG (``gemflow.airflow_api.wait_for_run``)."""
        try:
            return wait_for_run(self.api(), dag_id, timeout, echo, poll)
        except AirflowRunFailed as err:
            raise PlatformError(str(err)) from None

    # state
    def read_state(self) -> dict | None:
        if not self.state_file.exists():
            return None
        return json.loads(self.state_file.read_text())

    def _write_state(self, state: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    def running(self) -> list[Service]:
        state = self.read_state() or {}
        return [s for s in (Service(**d) for d in state.get("services", [])) if alive(s)]

    # start
    def _start(self, name: str, cmd: list[str], env: dict[str, str], url: str = "") -> Service:
        return spawn(name, cmd, env, self.ws.root, self.logs, url)

    def _wait(self, svc: Service, ready, what: str) -> None:
        wait_ready(svc, ready, what, self.cfg.start_timeout)

    def check_ports(self) -> None:
        c = self.cfg
        ports = {
            "airflow_port": c.airflow_port,
            "mlflow_port": c.mlflow_port,
            "endpoint_port": c.endpoint_port,
            **({"events_port": c.events_port} if c.start_events else {}),
        }
        seen: dict[int, str] = {}
        for key, port in ports.items():
            if port in seen:
                raise PlatformError(f"{key} and {seen[port]} are both {port}: give each service its own port")
            seen[port] = key
        taken = [f"{key}={port}" for key, port in ports.items() if not port_free(c.host, port)]
        if taken:
            raise PlatformError(
                f"port(s) already in use on {c.host}: {', '.join(taken)}; stop what holds them or choose others "
                f"(gemflow up --set airflow_port=… / mlflow_port=… / endpoint_port=… / events_port=…)"
            )

    def up(self, echo=print) -> dict:
        live = self.running()
        if live:
            raise PlatformError(
                f"the platform already runs on {self.ws.root} ({', '.join(s.name for s in live)}): "
                f"`gemflow down` first"
            )
        if self.state_file.exists():  # a previous run died without `down`: clean up what it left
            self.down(echo=lambda *_: None)
        airflow = self.airflow_bin / "airflow"
        if not airflow.exists():
            raise PlatformError(f"the Airflow environment is missing ({airflow}); run `make setup`")
        self.check_ports()
        marker = uuid.uuid4().hex
        env = self.env(marker)
        state = {
            "marker": marker,
            "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "config": asdict(self.cfg),
            "services": [],
        }
        self._write_state(state)  # before the first spawn: `down` can always find the marker

        def record(svc: Service) -> Service:
            state["services"].append(asdict(svc))
            self._write_state(state)
            return svc

        try:
            self._start_all(env, record, echo)
        except BaseException:
            echo("start failed: stopping what was started")
            self.down(echo=echo)
            raise
        return state

    def _start_all(self, env: dict[str, str], record, echo) -> None:
        from models.tracking.registry.server import server_command

        c = self.cfg
        self.airflow_home.mkdir(parents=True, exist_ok=True)
        mlflow = record(self._start("mlflow", self.mlflow_command(server_command), env, self.mlflow_url))
        echo(f"mlflow          pid {mlflow.pid}  starting on {self.mlflow_url}")

        t0 = time.monotonic()
        migrate = subprocess.run(
            [str(self.airflow_bin / "airflow"), "db", "migrate"], env=env, capture_output=True, text=True
        )
        if migrate.returncode:
            raise PlatformError(
                f"airflow db migrate failed:\n{migrate.stdout[-2000:]}\n{migrate.stderr[-2000:]}"
            )
        echo(f"airflow db      migrated in {time.monotonic() - t0:.0f}s ({self.airflow_home / 'airflow.db'})")

        af = str(self.airflow_bin / "airflow")
        api = record(self._start(
            "airflow-api-server",
            [af, "api-server", "--host", c.host, "--port", str(c.airflow_port), "--workers", str(c.api_workers)],
            env, self.airflow_url,
        ))  # fmt: skip
        echo(f"api-server      pid {api.pid}  starting on {self.airflow_url}")
        # The scheduler's tasks talk to the execution API from their first second: a task started before the API
        # server listens fails at once ("Connection refused"), so the API server answers before anything runs.
        health = f"{self.airflow_url}/api/v2/monitor/health"
        self._wait(api, lambda: http_ok(health) is not None, "answering /api/v2/monitor/health")
        echo(f"api-server      answering after {time.monotonic() - t0:.0f}s")
        for name, cmd in (
            ("airflow-scheduler", [af, "scheduler", "--skip-serve-logs"]),
            ("airflow-dag-processor", [af, "dag-processor"]),
            ("airflow-triggerer", [af, "triggerer", "--skip-serve-logs"]),
        ):
            svc = record(self._start(name, cmd, env))
            echo(f"{name[8:]:<15} pid {svc.pid}")

        self._wait(mlflow, lambda: http_ok(f"{self.mlflow_url}/health") is not None, "answering /health")
        running_ui.record(self.ws.root, self.mlflow_url)  # so commands on other workspaces can say so
        echo(f"mlflow          ready: {self.mlflow_url}")
        self._wait(api, lambda: self._airflow_healthy(), "healthy (scheduler, DAG processor, triggerer)")
        echo(f"airflow         ready: {self.airflow_url}")
        if c.start_events:
            self._start_events(env, record, echo)
        if c.deploy_endpoint:
            self._deploy_endpoint(env, record, echo)

    def _start_events(self, env: dict[str, str], record, echo) -> None:
        """The live event path (``serving.events``) on the workspace's online store and raw log."""
        c = self.cfg
        cmd = [
            str(self.project_bin / "gemflow"),
            "events",
            "serve",
            "--host",
            c.host,
            "--port",
            str(c.events_port),
        ]
        svc = record(self._start("events", cmd, env, self.events_url))
        self._wait(
            svc, lambda: http_ok(f"{self.events_url}/health/live") is not None, "answering /health/live"
        )
        echo(f"events          ready: {self.events_url} (POST /v1/events)")

    def mlflow_command(self, server_command) -> list[str]:
        """The MLflow server on the workspace's backend, its artifacts a local folder (not ``mlflow-artifacts:/``).

        The stages write to the same SQLite backend and artifact folder directly (as without the platform); a
        server that proxied artifacts would give the experiments it creates (``Default``) an
        ``mlflow-artifacts:/`` location that such a client cannot write to ("When an mlflow-artifacts URI was
        supplied, the tracking URI must be a valid http or https URI")."""
        cmd = server_command(self.ws.mlflow, self.cfg.host, self.cfg.mlflow_port)
        i = cmd.index("--artifacts-destination")
        artifacts = (self.ws.mlflow / "artifacts").resolve().as_uri()
        return [*cmd[:i], "--default-artifact-root", artifacts, "--no-serve-artifacts", *cmd[i + 2 :]]

    def _airflow_healthy(self) -> bool:
        health = http_ok(f"{self.airflow_url}/api/v2/monitor/health")
        if not health:
            return False
        parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
        return all((health.get(p) or {}).get("status") == "healthy" for p in parts)

    def _deploy_endpoint(self, env: dict[str, str], record, echo) -> None:
        """Serve the ranker champion now if there is one; otherwise the deploy DAG will."""
        gemflow = str(self.project_bin / "gemflow")
        version = champion_version(self.ws, "gem-ranker")
        if version is None:
            echo(
                "endpoint        no gem-ranker@champion yet: the gemflow_deploy DAG starts it once one is promoted"
            )
            return
        log = self.logs / "endpoint-deploy.log"
        with open(log, "ab") as out:
            done = subprocess.run(
                [gemflow, "deploy", "--mode", "local", "--port", str(self.cfg.endpoint_port)],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        if done.returncode:
            echo(f"endpoint        deploy failed (exit {done.returncode}); see {log}")
            return
        pid_file = self.ws.root / "serving" / "server.pid"
        if pid_file.exists():
            pid = int(pid_file.read_text())
            record(
                Service(
                    "endpoint",
                    pid,
                    pid,
                    start_ticks(pid) or 0,
                    ["gemflow", "serve"],
                    str(log),
                    self.endpoint_url,
                )
            )
        echo(f"endpoint        ready: {self.endpoint_url} (gem-ranker@champion v{version})")

    def restart(self, name: str, echo=print) -> Service:
        """Start the recorded service ``name`` again (same command, environment and marker), e.g. after it was
        killed: its old process group is stopped first if anything of it is left. ``down`` stops the new one."""
        state = self.read_state()
        if state is None:
            raise PlatformError(f"the platform is not running from {self.ws.root} (no {self.state_file})")
        services = [Service(**d) for d in state["services"]]
        old = next((s for s in services if s.name == name), None)
        if old is None:
            raise PlatformError(f"no service {name!r}; recorded: {', '.join(s.name for s in services)}")
        if name == "endpoint":
            raise PlatformError("the endpoint is the deploy DAG's: trigger gemflow_deploy to restart it")
        # The old group goes whole, its leader dead or not: a killed scheduler's workers and task processes
        # would otherwise stay behind as orphans (its tasks are then retried by the new scheduler).
        stop_group(old.pgid, self.cfg.stop_timeout)
        self.cfg = PlatformConfig(**state["config"])
        new = self._start(name, old.cmd, self.env(state["marker"]), old.url)
        state["services"] = [asdict(new) if s.name == name else asdict(s) for s in services]
        self._write_state(state)
        echo(f"restarted {name}: pid {new.pid} (was {old.pid})")
        return new

    # stop
    def down(self, echo=print) -> list[str]:
        """Stop the recorded process groups, then every process still carrying the marker; forget the state."""
        state = self.read_state()
        if state is None:
            echo(f"nothing recorded under {self.state_file}: the platform is not running from this workspace")
            return []
        services = [Service(**d) for d in state.get("services", [])]
        stopped, others = stop_services(services, state["marker"], self.cfg.stop_timeout, echo)
        pid_file = self.ws.root / "serving" / "server.pid"
        if pid_file.exists() and not start_ticks(int(pid_file.read_text())):
            pid_file.unlink()  # the endpoint went down with the platform
        self.state_file.unlink()
        running_ui.forget(self.ws.root)
        for line in stopped:
            echo(f"stopped {line}")
        if others:
            echo(
                f"stopped {len(others)} more process(es) started by the platform (tasks, ranks, model server)"
            )
        return stopped
