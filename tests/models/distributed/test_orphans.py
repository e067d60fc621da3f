"""No orphaned ranks: a launcher terminated (SIGTERM) or killed (SIGKILL) mid-training takes its ranks with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemflow.processes import ProcessRef
from tests.models.distributed.conftest import write_learnable_set

pytestmark = pytest.mark.integration  # two real 2-rank launches

REPO = Path(__file__).resolve().parents[3]
LONG_RUN = {  # far more steps than the test lets it run
    "user_model.d_model": 64,
    "user_model.max_history": 64,
    "optim.epochs": 500,
    "distributed.tokens_per_step": 2000,
    "distributed.threads_per_rank": 1,
    "distributed.peak_tflops": 0.05,
    "tracking.enabled": "false",
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("orphans")
    write_learnable_set(root / "training" / "learnable", num_users=120)
    return root


def _ranks_started(run: Path, launcher: subprocess.Popen, nproc: int, timeout: float = 600) -> dict[int, int]:
    """pid -> start time of every rank, once all of them have written their pid file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert launcher.poll() is None, f"the launcher exited early with {launcher.returncode}"
        files = sorted((run / "ranks").glob("rank-*.pid"))
        if len(files) == nproc:
            pids = [int(f.read_text()) for f in files]
            refs = [ProcessRef.of(pid) for pid in pids]
            if all(refs):
                return {ref.pid: ref.start for ref in refs}
        time.sleep(0.5)
    raise AssertionError(f"the ranks did not start within {timeout:.0f}s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_rank_outlives_its_launcher(root, sig):
    run = root / f"run-{sig.name}"
    args = [sys.executable, "-m", "gemflow.cli", "train", "--model", "user", "--training-set", "learnable",
            "--workspace", str(root), "--nproc", "2", "--set", f"output_dir={run}"]  # fmt: skip
    for key, value in LONG_RUN.items():
        args += ["--set", f"{key}={value}"]
    with open(root / f"{run.name}.log", "ab") as log:
        launcher = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    ranks: dict[int, int] = {}
    try:
        ranks = _ranks_started(run, launcher, nproc=2)
        launcher.send_signal(sig)
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 20  # SIGTERM: a graceful stop; SIGKILL: the watchdogs' poll
        while (
            any(ProcessRef(pid, start).running() for pid, start in ranks.items())
            and time.monotonic() < deadline
        ):
            time.sleep(0.25)
        alive = [pid for pid, start in ranks.items() if ProcessRef(pid, start).running()]
        assert not alive, f"rank(s) {alive} outlived a launcher stopped by {sig.name}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid, start in ranks.items():
            if ProcessRef(pid, start).running():
                os.kill(pid, signal.SIGKILL)  # leave nothing behind even when the assertion failed
