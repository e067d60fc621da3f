"""``serving.parent_watch.when_parent_exits`` with real processes: a child outlives neither a parent that dies
while it runs nor one that died before the child started watching (a spawned child imports for seconds first)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

# The parent starts the child with its own pid, prints the child's pid and exits after ``parent_lives`` s; the
# child starts watching only after ``child_waits`` s and then waits forever (until the watch ends it).
PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[3]])
print(child.pid, flush=True)
time.sleep(float(sys.argv[2]))
"""
CHILD = """
import os, sys, time
from serving.parent_watch import when_parent_exits
time.sleep(float(sys.argv[2]))
when_parent_exits(lambda: os._exit(0), int(sys.argv[1]))
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
