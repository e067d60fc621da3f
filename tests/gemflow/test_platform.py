"""``gemflow down`` stops exactly what ``up`` started: the recorded process groups and every process carrying the
start's marker (an orphan that left its group: a task process, a training rank, the model server), nothing else;
``up`` refuses taken or duplicate ports before starting anything. Real processes, no Airflow needed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from gemflow.platform import Platform
from gemflow.platform_env import PlatformConfig
from gemflow.probes import port_free
from gemflow.processes import start_ticks
from gemflow.services import MARKER, PlatformError, Service
from gemflow.workspace import Workspace

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
# a child that leaves its parent's process group (as Airflow's task processes and `gemflow serve` do)
ESCAPER = [sys.executable, "-c",
           "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
           " start_new_session=True); time.sleep(600)"]  # fmt: skip


def _alive(pid: int) -> bool:
    return start_ticks(pid) is not None


def _has_marker(pid: int, marker: str) -> bool:
    try:
        return f"{MARKER}={marker}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone meanwhile
        return False


def _spawn(cmd: list[str], marker: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, env={**os.environ, MARKER: marker}, start_new_session=True)


def test_down_stops_recorded_groups_and_marked_orphans_only(tmp_path):
    p = Platform(Workspace(tmp_path / "ws"), PlatformConfig(stop_timeout=10))
    marker = "test-" + os.urandom(4).hex()
    service = _spawn(ESCAPER, marker)
    bystander = subprocess.Popen(SLEEPER, start_new_session=True)  # not ours: no marker, not recorded
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait for the escaped grandchild
            kids = [int(x) for x in subprocess.run(["pgrep", "-f", "time.sleep\\(600\\)"], capture_output=True,
                                                   text=True).stdout.split()]  # fmt: skip
            orphans = [  # this test's escaped grandchild: other tests' sleepers (another xdist worker) are not
                k for k in kids
                if k not in (service.pid, bystander.pid) and _has_marker(k, marker) and os.getpgid(k) != service.pid
            ]  # fmt: skip
            if orphans:
                break
            time.sleep(0.2)
        assert orphans, "the escaping child did not start"
        svc = Service("svc", service.pid, service.pid, start_ticks(service.pid), ESCAPER, "log")
        p.dir.mkdir(parents=True)
        p.state_file.write_text(json.dumps({"marker": marker, "config": {}, "services": [svc.__dict__]}))

        lines: list[str] = []
        p.down(echo=lines.append)
        service.wait(timeout=10)
        assert not any(_alive(o) for o in orphans)  # the orphan went too (by its marker)
        assert bystander.poll() is None  # and nothing else
        assert any("svc" in line for line in lines) and not p.state_file.exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_up_refuses_taken_and_duplicate_ports_before_starting_anything(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert not port_free("127.0.0.1", taken)
        p = Platform(Workspace(tmp_path / "ws"), PlatformConfig(mlflow_port=taken, airflow_port=0))
        with pytest.raises(PlatformError, match=f"mlflow_port={taken}"):
            p.check_ports()
    p = Platform(Workspace(tmp_path / "ws"), PlatformConfig(airflow_port=18999, endpoint_port=18999))
    with pytest.raises(PlatformError, match="both 18999"):
        p.up(echo=lambda *_: None)
    assert not (tmp_path / "ws" / "platform" / "state.json").exists()


def test_env_binds_loopback_and_moves_the_base_url_with_the_port(tmp_path):
    p = Platform(Workspace(tmp_path / "ws"), PlatformConfig(airflow_port=18123))
    env = p.env("m")
    assert env["AIRFLOW__API__HOST"] == "127.0.0.1"
    assert env["AIRFLOW__API__BASE_URL"] == "http://127.0.0.1:18123"
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:18123/execution/"
    assert env["PATH"].split(os.pathsep)[0].endswith(".venv-airflow/bin")  # Airflow starts `airflow` by name
    assert env[MARKER] == "m" and env["GEMFLOW_LANDING"] == "synthetic"
    assert env["GEMFLOW_DATA_ENGINE"] == "local"  # the training sets' engine (ENGINE=spark flips it)
    spark = Platform(Workspace(tmp_path / "ws2"), PlatformConfig(airflow_port=18123, data_engine="spark"))
    assert spark.env("m")["GEMFLOW_DATA_ENGINE"] == "spark"
    assert p.env("m")["AIRFLOW__API_AUTH__JWT_SECRET"] == env["AIRFLOW__API_AUTH__JWT_SECRET"]  # kept
    cmd = p.mlflow_command(lambda root, host, port: ["mlflow", "server", "--artifacts-destination", "x",
                                                     "--host", host])  # fmt: skip
    assert "--no-serve-artifacts" in cmd and "--artifacts-destination" not in cmd


def test_restart_replaces_a_killed_service_and_its_leftover_group(tmp_path):
    """A killed leader's group (workers, task processes) goes whole; the new process runs the same command with
    the same marker, is recorded in its place, and ``down`` stops it."""
    p = Platform(Workspace(tmp_path / "ws"), PlatformConfig(stop_timeout=10))
    marker = "test-" + os.urandom(4).hex()
    worker = [sys.executable, "-c",
              "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(600)']); time.sleep(600)"]  # a child that stays in the group  # fmt: skip
    leader = _spawn(worker, marker)
    svc = Service("sched", leader.pid, leader.pid, start_ticks(leader.pid), SLEEPER, "log")
    p.dir.mkdir(parents=True)
    p.state_file.write_text(
        json.dumps({"marker": marker, "config": {"stop_timeout": 10}, "services": [svc.__dict__]})
    )
    try:
        time.sleep(1.0)  # the child is up
        os.kill(leader.pid, 9)  # the leader dies; its child stays behind in the group
        leader.wait(timeout=10)
        assert subprocess.run(["pgrep", "-g", str(leader.pid)], capture_output=True).returncode == 0
        new = p.restart("sched", echo=lambda *_: None)
        assert subprocess.run(["pgrep", "-g", str(leader.pid)], capture_output=True).returncode == 1
        recorded = [s for s in p.running() if s.name == "sched"]
        assert [s.pid for s in recorded] == [new.pid] and new.pid != leader.pid
        env = Path(f"/proc/{new.pid}/environ").read_bytes().split(b"\0")
        assert f"{MARKER}={marker}".encode() in env
        with pytest.raises(PlatformError, match="no service"):
            p.restart("nothing")
    finally:
        p.down(echo=lambda *_: None)
    assert not _alive(new.pid)


def test_events_port_is_checked_with_the_others(tmp_path):
    p = Platform(Workspace(tmp_path / "ws"), PlatformConfig(endpoint_port=18998, events_port=18998))
    with pytest.raises(PlatformError, match="both 18998"):
        p.check_ports()
    assert p.env("m")["GEMFLOW_EVENTS_URL"] == "http://127.0.0.1:18998"


@pytest.mark.integration
def test_the_event_collector_starts_as_a_platform_service_and_down_stops_it(tmp_path):
    import httpx

    from tests.ports import free_port

    p = Platform(Workspace(tmp_path / "ws"), PlatformConfig(events_port=free_port(), start_timeout=180))
    state = {"marker": "test-" + os.urandom(4).hex(), "services": []}
    p._write_state(state)

    def record(svc: Service) -> Service:
        state["services"].append(asdict(svc))
        p._write_state(state)
        return svc

    lines: list[str] = []
    p._start_events(p.env(state["marker"]), record, lines.append)
    assert httpx.get(f"{p.events_url}/health/live", timeout=5).status_code == 200
    assert any("POST /v1/events" in line for line in lines)
    p.down(echo=lines.append)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{p.events_url}/health/live", timeout=2)
