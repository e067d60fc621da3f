"""Process lifecycle, one implementation for the platform (``gemflow up``), the model server and its children, and the
distributed trainer's launcher and ranks: which process is which, starting a child in a process group of its own,
watching a process until it is gone, stopping a group (TERM, then KILL), finding what a process left behind, and
pacing the restarts of a child that keeps dying.

Each user keeps only what is its own: the platform its recorded services and marker (``gemflow.platform``), the
server its prefork supervisor and scoring pool (``serving.server_processes``, ``serving.scoring_processes``), the
trainer the launcher variables its ranks watch (``models.training.distributed.launch``).

psutil (installed) covers the process table but not process groups, ``PR_SET_PDEATHSIG`` or restart pacing; a
process's identity here is its pid with its start time in clock ticks (``/proc/<pid>/stat``), an integer that the
platform records in its state file (a reused pid has another start time).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
POLL_S = 1.0  # how often a watch looks at the process it watches


def start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot; None when there is none or it has exited (a
    zombie, not yet reaped, has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # fields 3 on of proc(5): the command name may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


@dataclass(frozen=True)
class ProcessRef:
    """One process, not just its pid: a pid reused by another process has another start time."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ProcessRef | None:
        start = start_ticks(pid)
        return None if start is None else cls(pid, start)

    @classmethod
    def me(cls) -> ProcessRef:
        return cls.of(os.getpid())

    def running(self) -> bool:
        return start_ticks(self.pid) == self.start


def when_gone(ref: ProcessRef, then: Callable[[], None], poll_s: float = POLL_S) -> threading.Thread:
    """Call ``then`` on a daemon thread once the process ``ref`` is gone. A child that must not outlive its parent
    gets ``ref`` from the parent itself (``ProcessRef.me()`` passed at spawn): a spawned child imports for seconds
    before it can start watching, and a parent that died in that time must not look like the one it has now
    (init); such a child calls ``then`` at once."""

    def watch() -> None:
        while ref.running():
            time.sleep(poll_s)
        then()

    thread = threading.Thread(target=watch, daemon=True, name=f"watch-{ref.pid}")
    thread.start()
    return thread


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn``: the kernel SIGTERMs the child when the process that forked it dies, even by SIGKILL (Linux;
    None elsewhere). libc is loaded here, in the parent: between fork and exec the child makes only the one call."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_group(pgid: int, grace: float, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM process group ``pgid``, SIGKILL what is left of it after ``grace`` seconds. ``leader``: the group's
    leader when it is this process's child, reaped here (a zombie leader would keep the group alive)."""
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()
        if not group_alive(pgid):
            return
        time.sleep(0.1)
    signal_group(pgid, signal.SIGKILL)
    if leader is not None:
        leader.wait()


def _raise_exit(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds into run_in_own_group's cleanup


def run_in_own_group(cmd: list[str], *, env: dict[str, str], cwd: Path, grace: float = 15.0) -> int:
    """Run ``cmd`` to completion in a process group of its own; however this process ends, the group ends too:
    terminated (SIGTERM, Ctrl-C) or failing, it stops the group; killed (SIGKILL), the kernel SIGTERMs the child
    (``die_with_parent``), whose own job it is to stop what it started."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_exit) if on_main else None
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True, preexec_fn=die_with_parent())
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:  # this process is being terminated, or failed while waiting
            log.warning("stopping process group %d (%s)", proc.pid, Path(cmd[0]).name)
            stop_group(proc.pid, grace, leader=proc)
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def stop_processes(procs: Iterable[multiprocessing.Process], grace: float, terminate: bool = True) -> None:
    """Stop ``multiprocessing`` children: SIGTERM each (unless ``terminate`` is off: they were asked some other way),
    give them ``grace`` seconds together, SIGKILL those still running."""
    procs = list(procs)
    if terminate:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def pids_with_env(name: str, value: str) -> list[int]:
    """Every live process of this user (this one aside) whose environment carries ``name=value``: what left its
    starter's process group (a task process, a training rank, a server in a session of its own) keeps that."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and start_ticks(int(entry.name)):
                found.append(int(entry.name))
        except OSError:  # gone, or another user's
            continue
    return found


class Backoff:
    """How long to wait before restarting a child that died: at once, then after 1 s, 2, 4, ... up to ``max_s``
    while it keeps dying; a quiet spell (no death for ``reset_after_s``) or a success (``reset``) starts over."""

    def __init__(self, first_s: float = 1.0, max_s: float = 60.0, reset_after_s: float = 300.0):
        self.first_s, self.max_s, self.reset_after_s = first_s, max_s, reset_after_s
        self._delay: float | None = None  # None: no death since the last reset
        self._last = -float("inf")

    def next_delay(self) -> float:
        """The wait before restarting a child that just died."""
        now = time.monotonic()
        if self._delay is None or now - self._last > self.reset_after_s:
            self._delay = 0.0
        else:
            self._delay = min(max(2 * self._delay, self.first_s), self.max_s)
        self._last = now
        return self._delay

    def reset(self) -> None:
        self._delay = None
