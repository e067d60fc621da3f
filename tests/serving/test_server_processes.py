"""``server_processes=2``: two whole server processes on one port (SO_REUSEPORT), counted as one server, a dead one
restarted, all of them stopped by SIGTERM; a taken port is a one-line error."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from serving import stats
from serving.client import get, post, v1_body
from serving.config import ScoringConfig, ServingConfig
from tests.serving.conftest import SERVER_SETTINGS
from tests.serving.world import HEALTHY_USERS, MODEL, REQUEST_TS, free_port, running_server

PROCESSES = ("server_processes=2", "scoring.workers=1")


def _pids_answering(base: str, want: int, timeout: float = 120.0) -> set[int]:
    """The server processes answering new connections, polled until ``want`` distinct ones answered."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < want and time.monotonic() < deadline:
        status, body = get(
            f"{base}/v2/models/{MODEL}/stats"
        )  # a new connection each: the kernel spreads them
        if status == 200:
            seen.add(body["pid"])
        time.sleep(0.05)
    return seen


def _rank(base: str, n: int) -> list[int]:
    body = v1_body(HEALTHY_USERS[0], [1, 2, 3], {"request_ts": REQUEST_TS})
    return [post(f"{base}/v1/models/{MODEL}:predict", body)[0] for _ in range(n)]


def _metric(base: str, line_start: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def _assert_nobody_listens(port: int) -> None:
    with socket.socket() as s:  # (SO_REUSEADDR: the port's closed connections may linger in TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # fails while any process listens there
        s.listen()


@pytest.mark.integration
def test_two_server_processes_count_as_one_and_a_dead_one_is_replaced(world, tmp_path):
    port = free_port()
    with running_server(world, port, tmp_path / "serve.log", *SERVER_SETTINGS, *PROCESSES) as base:
        first = _pids_answering(base, 2)
        assert len(first) == 2, f"only {first} answered"
        codes = _rank(base, 30)
        assert codes == [200] * 30
        stats = get(f"{base}/v2/models/{MODEL}/stats")[1]["stats"]
        # every process's answers, whichever process reports them
        assert stats["answered"] == 30 and stats["responses"]["v1_predict 200"] == 30
        assert _metric(base, 'gemflow_ranker_http_responses_total{code="200",route="v1_predict"}') == 30

        victim = min(first)
        dying = psutil.Process(victim)
        supervisor = dying.parent()
        os.kill(victim, signal.SIGKILL)
        dying.wait(10)  # (connections queued on its socket when it died are reset: a crash's cost)
        assert _rank(base, 10) == [200] * 10  # the other process answers meanwhile
        now = _pids_answering(base, 2, timeout=180)
        assert len(now) == 2 and victim not in now, f"{victim} not replaced: {now}"
        # the dead process's answers still count (counters outlive it)
        assert get(f"{base}/v2/models/{MODEL}/stats")[1]["stats"]["answered"] == 40

        children = supervisor.children(recursive=True)
        assert now <= {c.pid for c in children}
    # running_server sent SIGTERM and waited for the supervisor: nothing of it is left, and the port is free.
    # (multiprocessing's resource tracker exits when the supervisor's end of its pipe closes: on a busy machine
    # a few ms after the supervisor, hence the bounded wait.)
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE]
    _assert_nobody_listens(port)


@pytest.mark.integration
def test_server_processes_exit_when_their_supervisor_is_killed(world, tmp_path):
    port = free_port()
    with running_server(world, port, tmp_path / "serve.log", *SERVER_SETTINGS, *PROCESSES) as base:
        pids = _pids_answering(base, 2)
        supervisor = psutil.Process(next(iter(pids))).parent()
        supervisor.kill()  # SIGKILL: it stops nobody itself
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids], timeout=60)
        assert not alive, f"{[p.pid for p in alive]} still run without their supervisor"
    _assert_nobody_listens(port)


def test_a_taken_port_is_a_one_line_error(world):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "gemflow.cli", "serve", "--workspace", str(world.ws.root), "--model-uri",
             str(world.model_path), "--http-port", str(port), *(a for p in PROCESSES for a in ("--set", p))],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 1
    assert f"error: cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_process_that_cannot_load_its_model_stops_the_server_with_its_error(world, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "gemflow.cli", "serve", "--workspace", str(world.ws.root), "--model-uri",
         str(tmp_path / "no-such-model"), "--http-port", str(free_port()),
         *(a for p in PROCESSES for a in ("--set", p))],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    assert "no-such-model" in out.stderr and "before it listened" in out.stderr  # not restarted in a loop
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"server_processes": 0}, "server_processes must be >= 1"),
     ({"server_processes": 2, "scoring": ScoringConfig(processes=2)}, "do not combine")],
)  # fmt: skip
def test_server_processes_config_is_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        ServingConfig(**settings)


def test_only_the_supervisors_processes_sum_their_metrics(monkeypatch, tmp_path):
    """Feast sets ``$PROMETHEUS_MULTIPROC_DIR`` when imported, and processes started from one that imported it
    inherit the folder: that alone must not make a single server sum other servers' counts."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.delenv(stats.SHARED_METRICS_ENV, raising=False)
    assert not stats.multiprocess()
    monkeypatch.setenv(stats.SHARED_METRICS_ENV, "1")  # what the supervisor sets for its server processes
    assert stats.multiprocess()
