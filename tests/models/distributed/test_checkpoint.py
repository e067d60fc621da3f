"""Checkpoint commits: a save interrupted at any point is never what a resume loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from models.distributed.checkpoint import CheckpointError, CheckpointStore


def _write(value: str):
    def write(folder):
        (folder / "part.txt").write_text(value)

    return write


def test_save_commits_by_rename_then_points_latest_at_it(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", rank=0, keep=2)
    assert store.latest() is None
    path = store.save(10, _write("ten"))
    assert store.latest() == path and (path / "part.txt").read_text() == "ten"
    assert not list((tmp_path / "ckpt").glob(".*.tmp"))


def test_a_write_that_fails_midway_leaves_the_previous_checkpoint_as_latest(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", rank=0, keep=2)
    good = store.save(10, _write("ten"))

    def crash(folder):
        (folder / "part.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.save(20, crash)
    assert store.latest() == good
    assert (tmp_path / "ckpt" / ".step-00000020.tmp").exists()  # the debris is never read ...
    assert store.remove_stale() == [tmp_path / "ckpt" / ".step-00000020.tmp"]  # ... and is removed at start
    assert store.committed() == [good]


def test_a_process_killed_during_the_write_never_commits(tmp_path):
    """A real SIGKILL halfway through writing: only the earlier checkpoint is loadable afterwards."""
    root = tmp_path / "ckpt"
    code = textwrap.dedent(
        f"""
        import os, signal, time
        from models.distributed.checkpoint import CheckpointStore
        store = CheckpointStore({str(root)!r}, rank=0, keep=2)
        store.save(1, lambda f: (f / "part.txt").write_text("one"))
        def write(folder):
            (folder / "part.txt").write_text("partial")
            os.kill(os.getpid(), signal.SIGKILL)
        store.save(2, write)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.getcwd(), timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL
    store = CheckpointStore(root, rank=0)
    assert store.latest().name == "step-00000001"
    assert (store.latest() / "part.txt").read_text() == "one"


def test_keeps_only_the_newest_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", rank=0, keep=2)
    for step in (1, 2, 3, 4):
        store.save(step, _write(str(step)))
    assert [p.name for p in store.committed()] == ["step-00000003", "step-00000004"]


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", rank=0, keep=2)
    store.save(5, _write("first"))
    (store.latest() / "extra.txt").write_text("stale")
    path = store.save(5, _write("second"))
    assert (path / "part.txt").read_text() == "second" and not (path / "extra.txt").exists()


def test_latest_naming_a_missing_checkpoint_is_a_clear_error(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "latest").write_text("step-00000009")
    with pytest.raises(CheckpointError, match="step-00000009.*not a committed checkpoint"):
        CheckpointStore(root, rank=0).latest()
