"""No orphaned ranks: a distributed run never outlives the process that launched it.

Three layers, because each covers a way the launcher can go:
- the launcher starts torchrun (or the DeepSpeed CLI) in a process group of its own and, when it is terminated
  (SIGTERM, Ctrl-C) or fails, stops that group (torchrun then stops its ranks, which it starts in sessions of
  their own): ``gemflow.processes.run_in_own_group``;
- the kernel sends torchrun SIGTERM when the launcher dies, even by SIGKILL (``PR_SET_PDEATHSIG``), and
  torchrun then stops its ranks;
- each rank watches the launcher named in its environment (its pid and start time, ``launcher_env``) and is
  killed when the launcher is gone: ``start_watchdog``. This one holds whatever sits between launcher and ranks
  (torchrun killed too, the DeepSpeed CLI's own launcher process).

The process mechanics are ``gemflow.processes``'; what is the trainer's own is which variables name the launcher.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from gemflow.processes import ProcessRef, when_gone

log = logging.getLogger(__name__)

LAUNCHER_PID = "GEMFLOW_LAUNCHER_PID"
LAUNCHER_START = "GEMFLOW_LAUNCHER_START"  # its start time in clock ticks since boot (/proc/<pid>/stat)


def launcher_env() -> dict[str, str]:
    """What the ranks need to watch this process."""
    me = ProcessRef.me()
    return {LAUNCHER_PID: str(me.pid), LAUNCHER_START: str(me.start)}


def start_watchdog(interval: float = 0.5) -> threading.Thread | None:
    """In a rank: exit as soon as the launcher named in the environment is gone. None when no launcher is named
    (a rank started by hand)."""
    pid, start = os.environ.get(LAUNCHER_PID), os.environ.get(LAUNCHER_START)
    if not (pid and start):
        return None
    launcher = ProcessRef(int(pid), int(start))

    def stop() -> None:
        log.error("the launcher (pid %d) is gone: this rank stops", launcher.pid)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup to wait for: checkpoints are crash-safe

    return when_gone(launcher, stop, poll_s=interval)
