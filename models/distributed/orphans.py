"""No orphaned ranks: a distributed run never outlives the process that launched it.

Three layers, because each covers a way the launcher can go:
- the launcher starts torchrun (or the DeepSpeed CLI) in a process group of its own and, when it is terminated
  (SIGTERM, Ctrl-C) or fails, stops that group (torchrun then stops its ranks, which it starts in sessions of
  their own): ``run_in_own_group``;
- the kernel sends torchrun SIGTERM when the launcher dies, even by SIGKILL (``PR_SET_PDEATHSIG``), and
  torchrun then stops its ranks;
- each rank runs a watchdog thread that polls the launcher (its pid and start time, so a reused pid does not
  fool it) and kills the rank when the launcher is gone: ``start_watchdog``. This one holds whatever sits
  between launcher and ranks (torchrun killed too, the DeepSpeed CLI's own launcher process).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

LAUNCHER_PID = "GEMFLOW_LAUNCHER_PID"
LAUNCHER_START = "GEMFLOW_LAUNCHER_START"  # its start time in clock ticks since boot (/proc/<pid>/stat)
PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 15.0  # SIGTERM, then SIGKILL: ranks may be mid-checkpoint, which is crash-safe anyway


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of a process, or None when there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5), counted after the command name


def is_running(pid: int, start: int) -> bool:
    """The same process (not a reused pid) exists and has not exited (a zombie has)."""
    stat = _stat(pid)
    return stat is not None and stat[1] == start and stat[0] not in ("Z", "X")


def launcher_env() -> dict[str, str]:
    """What the ranks need to watch this process."""
    me = os.getpid()
    return {LAUNCHER_PID: str(me), LAUNCHER_START: str(_stat(me)[1])}


def _die_with_parent():
    """A preexec_fn: SIGTERM the child when the process that forked it dies (Linux; None elsewhere). libc is
    loaded here, in the parent: between fork and exec the child only makes the one call."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _raise_exit(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds into run_in_own_group's cleanup


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL it after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_in_own_group(cmd: list[str], *, env: dict[str, str], cwd: Path) -> int:
    """Run ``cmd`` to completion in its own process group; however this process ends, the group ends too."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_exit) if on_main else None
    proc = subprocess.Popen(
        cmd, env={**env, **launcher_env()}, cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent()
    )
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:  # this process is being terminated, or failed while waiting
            log.warning("stopping the ranks (process group %d)", proc.pid)
            stop_group(proc)
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def start_watchdog(interval: float = 0.5) -> threading.Thread | None:
    """In a rank: exit as soon as the launcher named in the environment is gone. None when no launcher is named
    (a rank started by hand)."""
    pid, start = os.environ.get(LAUNCHER_PID), os.environ.get(LAUNCHER_START)
    if not (pid and start):
        return None
    pid, start = int(pid), int(start)

    def watch() -> None:
        while is_running(pid, start):
            time.sleep(interval)
        log.error("the launcher (pid %d) is gone: this rank stops", pid)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup to wait for: checkpoints are crash-safe

    thread = threading.Thread(target=watch, name="launcher-watchdog", daemon=True)
    thread.start()
    return thread
