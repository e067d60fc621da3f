"""``gemflow.processes`` with real processes: a child watching its parent (``when_gone``) outlives neither a parent
that dies while it runs nor one that died before the child started watching (a spawned child imports for seconds
first); ``stop_group`` stops a whole group, one that ignores SIGTERM too; ``Backoff`` paces restarts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gemflow.processes import Backoff, ProcessRef, group_alive, stop_group

ROOT = Path(__file__).resolve().parents[2]
IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"

# The parent starts the child with its own identity (pid, start time), prints the child's pid and exits after
# ``parent_lives`` s; the child starts watching only after ``child_waits`` s and then waits forever (until the watch ends it).
PARENT = """
import subprocess, sys, time
from gemflow.processes import ProcessRef
me = ProcessRef.me()
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(me.pid), str(me.start), sys.argv[3]])
print(child.pid, flush=True)
time.sleep(float(sys.argv[2]))
"""
CHILD = """
import os, sys, time
from gemflow.processes import ProcessRef, when_gone
time.sleep(float(sys.argv[3]))
when_gone(ProcessRef(int(sys.argv[1]), int(sys.argv[2])), lambda: os._exit(0))
time.sleep(600)
"""


@pytest.mark.parametrize(
    "parent_lives, child_waits", [(0.5, 3.0), (3.0, 0.0)], ids=["died_before_the_watch", "died_during_it"]
)
def test_the_child_exits_once_its_parent_is_gone(parent_lives, child_waits):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, str(parent_lives), str(child_waits)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        parent.wait(timeout=30)
        t0 = time.monotonic()
        child.wait(timeout=30)  # raises psutil.TimeoutExpired if the child never noticed
        assert time.monotonic() - t0 < child_waits + 5
    finally:
        if child.is_running():
            child.kill()
        parent.kill()


def test_stop_group_stops_every_member_and_kills_what_ignores_sigterm():
    """A group of a leader (this process's child) and a member that ignores SIGTERM: TERM ends the leader, the
    grace period runs out, KILL ends the member; the leader is reaped, nothing of the group is left."""
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1]]);"
         " time.sleep(600)", IGNORES_TERM],
        start_new_session=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert leader.stdout.readline().strip() == "ready"  # the member ignores SIGTERM from now on
        member = next(p for p in psutil.Process(leader.pid).children())
        stop_group(leader.pid, grace=2.0, leader=leader)
        assert leader.returncode == -15  # reaped, by the TERM
        member.wait(timeout=10)  # gone, by the KILL
        assert not group_alive(leader.pid)
    finally:
        if leader.poll() is None:
            leader.kill()


def test_a_process_ref_tells_a_process_from_a_reused_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    ref = ProcessRef.of(proc.pid)
    assert ref is not None and ref.running()
    assert not ProcessRef(proc.pid, ref.start + 1).running()  # same pid, another start: another process
    proc.kill()
    proc.wait()
    assert not ref.running() and ProcessRef.of(proc.pid) is None


def test_backoff_restarts_at_once_then_doubles_up_to_its_bound_and_starts_over_after_a_reset():
    backoff = Backoff(first_s=1.0, max_s=4.0)
    assert [backoff.next_delay() for _ in range(5)] == [0.0, 1.0, 2.0, 4.0, 4.0]
    backoff.reset()
    assert backoff.next_delay() == 0.0
