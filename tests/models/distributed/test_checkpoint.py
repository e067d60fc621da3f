"""Checkpoint commits: a save interrupted at any point is never what a resume loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from models.training.distributed.checkpoint import CheckpointError, CheckpointStore


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
        from models.training.distributed.checkpoint import CheckpointStore
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


def test_state_round_trips_pickle_free_and_restores_the_rng_streams(tmp_path):
    """What a resume reads of our own parts (RNG states, replicated tables with their optimizer) loads with
    ``weights_only=True``; numbers, strings and the nesting live in JSON beside the tensors."""
    import json
    import random

    import numpy as np
    import torch

    from models.training.distributed.checkpoint import load_state, save_state
    from models.training.distributed.run_checkpoint import rng_state, set_rng_state

    table = torch.nn.EmbeddingBag(5, 3)
    optim = torch.optim.Adagrad(table.parameters(), lr=0.1)
    table(torch.tensor([[1, 2]])).sum().backward()
    optim.step()  # optimizer state keyed by int, with tensors and floats
    state = {"rng": rng_state(), "replicated": {"model": table.state_dict(), "optim": optim.state_dict()}}
    save_state(state, tmp_path / "part")
    draws = (torch.rand(3), np.random.rand(3), random.random())

    json.loads((tmp_path / "part.json").read_text())  # plain JSON
    assert all(isinstance(t, torch.Tensor) for t in torch.load(tmp_path / "part.pt", weights_only=True))
    loaded = load_state(tmp_path / "part")
    set_rng_state(loaded["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1]) and draws[2] == again[2]
    other = torch.optim.Adagrad(table.parameters(), lr=0.1)
    other.load_state_dict(loaded["replicated"]["optim"])
    assert other.state_dict()["param_groups"] == optim.state_dict()["param_groups"]
    assert torch.equal(other.state_dict()["state"][0]["sum"], optim.state_dict()["state"][0]["sum"])


def test_state_refuses_what_needs_pickle(tmp_path):
    from models.training.distributed.checkpoint import save_state

    with pytest.raises(TypeError, match="without pickle"):
        save_state({"f": object()}, tmp_path / "bad")


def test_deepspeed_files_resume_with_weights_only(tmp_path, monkeypatch):
    """A real (one-process, ZeRO-2, bf16) DeepSpeed engine saves; a fresh engine loads it back with every file
    read ``weights_only=True`` and the same weights and optimizer step come back. The optimizer file does hold
    DeepSpeed types (the allow-list is needed, and it is all that is needed)."""
    import torch
    import torch.distributed as dist

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("LOCAL_RANK", "0")
    import deepspeed

    from models.training.distributed.checkpoint import weights_only_engine_loads

    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1, "zero_optimization": {"stage": 2},
              "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:

        def engine():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
            return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

        trained = engine()
        loss = trained(torch.randn(4, 16, dtype=torch.bfloat16)).float().pow(2).mean()
        trained.backward(loss)
        trained.step()
        trained.save_checkpoint(str(tmp_path / "dense"), tag="engine", save_latest=False)
        (optim_file,) = (tmp_path / "dense" / "engine").glob("*optim_states.pt")
        with pytest.raises(Exception, match="weights_only|Unsupported global"):
            torch.load(optim_file, weights_only=True)

        fresh = engine()
        with weights_only_engine_loads(fresh):
            fresh.load_checkpoint(str(tmp_path / "dense"), tag="engine")
        assert "load" not in vars(fresh.checkpoint_engine)  # the engine's own loader is back afterwards
        for a, b in zip(trained.module.parameters(), fresh.module.parameters(), strict=True):
            assert torch.equal(a, b)
        assert fresh.global_steps == trained.global_steps == 1
    finally:
        dist.destroy_process_group()
