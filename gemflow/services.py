"""The platform's supervisor: long-running services, each in a process group (session) of its own, recorded by
pid, group and start time (a reused pid is not the service); and one marker variable (``GEMFLOW_PLATFORM_ID``)
that every process a service starts inherits, so that ``stop_services`` finds what left its service's group (a task
process, a training rank, a model server in a session of its own). The process mechanics are
``gemflow.processes``'; which services the platform runs is ``gemflow.platform``'s, and their environment
``gemflow.platform_env``'s."""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gemflow.processes import pids_with_env, signal_group, signal_pid, start_ticks

MARKER = "GEMFLOW_PLATFORM_ID"


class PlatformError(RuntimeError):
    """The platform cannot start (a port is taken, a component exited) or is in an unexpected state."""


@dataclass
class Service:
    name: str
    pid: int
    pgid: int
    start_ticks: int  # /proc/<pid>/stat field 22: tells a recorded pid from a reused one
    cmd: list[str]
    log: str
    url: str = ""


def alive(svc: Service) -> bool:
    return start_ticks(svc.pid) == svc.start_ticks


def marked_pids(marker: str) -> list[int]:
    """Every live process of this user whose environment carries ``GEMFLOW_PLATFORM_ID=<marker>``."""
    return pids_with_env(MARKER, marker)


def spawn(name: str, cmd: list[str], env: dict[str, str], cwd: Path, logs: Path, url: str = "") -> Service:
    """Start ``cmd`` in a session of its own, its output appended to ``<logs>/<name>.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with open(log, "ab") as out:
        out.write(f"\n=== {dt.datetime.now(dt.UTC):%Y-%m-%dT%H:%M:%SZ} {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
    ticks = None
    for _ in range(50):
        ticks = start_ticks(proc.pid)
        if ticks is not None:
            break
        time.sleep(0.02)
    return Service(name, proc.pid, proc.pid, ticks or 0, cmd, str(log), url)


def wait_ready(svc: Service, ready: Callable[[], bool], what: str, timeout: float) -> None:
    """Until ``ready()``; a service that exits meanwhile fails with the end of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(svc):
            tail = Path(svc.log).read_text(errors="replace")[-3000:]
            raise PlatformError(f"{svc.name} exited while starting; {svc.log} ends with:\n{tail}")
        if ready():
            return
        time.sleep(1.0)
    raise PlatformError(f"{svc.name} was not {what} within {timeout:.0f}s; see {svc.log}")


def stop_services(
    services: list[Service], marker: str, timeout: float, echo=print
) -> tuple[list[str], list[int]]:
    """SIGTERM the services' process groups (the last started first) and every process carrying the marker, SIGKILL
    what is left after ``timeout`` seconds; (the services stopped, the other marked processes). Raises when a
    marked process survives SIGKILL."""
    stopped = []
    for svc in reversed(services):
        if alive(svc):
            signal_group(svc.pgid, signal.SIGTERM)
            stopped.append(f"{svc.name} (pid {svc.pid})")
    others = marked_pids(marker)
    for pid in others:
        signal_pid(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (any(alive(s) for s in services) or marked_pids(marker)):
        time.sleep(0.3)
    leftovers = marked_pids(marker)
    for svc in services:
        if alive(svc):
            signal_group(svc.pgid, signal.SIGKILL)
    for pid in leftovers:
        signal_pid(pid, signal.SIGKILL)
    if leftovers:
        echo(f"killed {len(leftovers)} process(es) that ignored SIGTERM: {leftovers}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and marked_pids(marker):
        time.sleep(0.2)
    still = marked_pids(marker)
    if still:
        raise PlatformError(f"processes of this platform survived SIGKILL: {still}")
    return stopped, others
