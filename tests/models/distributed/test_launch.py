"""Real multi-process runs on gloo through ``gemflow train --model user --nproc N``.

- 2 ranks with ZeRO-2 + MoE (experts split over both ranks) + FP8 reach the validation NE of a 1-rank run on
  the same data and step budget, in the same precision (bf16, pinned in conftest's COMMON), within 1%;
- fault tolerance: one rank SIGKILLed mid-training, then a relaunch crashing halfway through writing a
  checkpoint, then a final relaunch: the run resumes from the last committed checkpoint (never the half-written
  one) and ends on exactly the NE of an unbroken run; the same with ``zero_stage=auto`` (plain data parallel).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from models.architectures.layers import MixtureOfExperts
from models.inference.bundle import load_bundle
from models.training.distributed.run_checkpoint import CRASH_IN_CHECKPOINT
from tests.models.distributed.conftest import REPO, gemflow_train, write_learnable_set

pytestmark = pytest.mark.integration

FULL = {
    "user_model.ffn": "moe,moe",
    "distributed.moe.ep_size": 2,
    "distributed.moe.num_experts": 4,
    "distributed.zero_stage": 2,
    "distributed.fp8.recipe": "tensorwise",
    # one float8 GEMM for every run here: "auto" measures per run, and the two paths round differently, so an
    # unbroken and a resumed run could differ in the last bits (a resume keeps its own run's choice)
    "distributed.fp8.cpu_gemm": "emulated",
}


@pytest.fixture(scope="module")
def workspace_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dist-ws")
    write_learnable_set(root / "training" / "learnable", num_users=300)
    return root


@pytest.fixture(scope="module")
def unbroken_full(workspace_root) -> dict:
    return gemflow_train(workspace_root, "full-unbroken", 2, FULL)


def test_two_rank_zero2_moe_fp8_matches_one_rank_ne(workspace_root, unbroken_full):
    baseline = gemflow_train(workspace_root, "single", 1, {})
    full = unbroken_full
    for metrics in (
        baseline,
        full,
    ):  # both trained (the labels are learnable), so the comparison means something
        assert metrics["valid_ne"] < metrics["initial_valid_ne"] - 0.03
    rel = abs(full["valid_ne"] / baseline["valid_ne"] - 1)
    assert rel < 0.01, f"2-rank ZeRO-2+MoE+FP8 NE {full['valid_ne']:.4f} vs 1-rank {baseline['valid_ne']:.4f}"
    run = workspace_root / "full-unbroken"
    perf = json.loads((run / "perf.json").read_text())
    assert perf["nproc"] == 2 and perf["moe_layers"] == 2 and perf["fp8_linears"] > 0
    assert perf["fp8_gemm"] == "emulated"
    assert perf["token_imbalance_mean"] < 1.2
    assert isinstance(load_bundle(run).model.blocks[0].ffn, MixtureOfExperts)  # MoE + FP8 runs export too


def test_moe_export_gathers_both_ranks_experts_and_matches_the_engine(workspace_root):
    """ep_size 2: each rank trains 2 of the 4 experts; model.pt holds all of them as a plain MixtureOfExperts
    and scores like the engine's evaluation (fp32 engine, so the only difference is summation order)."""
    run = workspace_root / "moe-export"
    exact = {"distributed.precision": "fp32", "distributed.fp8.recipe": "none", "distributed.max_steps": 4}
    metrics = gemflow_train(workspace_root, "moe-export", 2, {**FULL, **exact})
    assert metrics["export_max_abs_logit_diff"] <= 1e-5

    payload = torch.load(run / "model.pt", map_location="cpu", weights_only=True)
    assert payload["moe"] == {"num_experts": 4, "top_k": 1}
    state = payload["state_dict"]
    assert not [k for k in state if "deepspeed" in k]
    exported = f"step-{int(metrics['best_step']):08d}"  # the best state's checkpoint (kept from pruning)
    engine_dir = run / "checkpoints" / exported / "dense" / "engine"
    # experts 0-1 were trained on rank 0, 2-3 on rank 1: each equals DeepSpeed's own file of it
    for layer in (0, 1):
        for expert in range(4):
            saved = torch.load(engine_dir / f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt",
                               map_location="cpu", weights_only=False)  # fmt: skip
            weight = next(
                v for k, v in saved.items() if k.endswith(f"deepspeed_experts.{expert}.net.0.weight")
            )
            torch.testing.assert_close(
                state[f"blocks.{layer}.ffn.experts.{expert}.net.0.weight"], weight.float()
            )
    # trained experts differ from each other (none is a copy of another rank's)
    w = [state[f"blocks.0.ffn.experts.{e}.net.0.weight"] for e in range(4)]
    assert all(not torch.equal(w[i], w[j]) for i in range(4) for j in range(i + 1, 4))

    bundle = load_bundle(run)  # no DeepSpeed needed: plain PyTorch MoE blocks
    assert isinstance(bundle.model.blocks[1].ffn, MixtureOfExperts)


def _wait_for_checkpoint(ckpt: Path, proc: subprocess.Popen, min_step: int, timeout: float = 900) -> None:
    """Until ``latest`` names a checkpoint of step >= ``min_step`` (step 0 is the untrained model's: the best
    state so far, checkpointed for export)."""
    deadline = time.monotonic() + timeout
    latest = ckpt / "latest"
    while not (latest.exists() and int(latest.read_text().removeprefix("step-")) >= min_step):
        assert proc.poll() is None, f"the run ended before a checkpoint of step {min_step}"
        assert time.monotonic() < deadline, f"no checkpoint of step {min_step} after {timeout}s"
        time.sleep(0.2)


def test_killed_rank_and_crash_mid_checkpoint_resume_to_the_unbroken_result(workspace_root, unbroken_full):
    run = workspace_root / "full-faults"
    ckpt = run / "checkpoints"

    # 1. SIGKILL rank 1 right after the first checkpoint (step 10 of ~38) is committed
    proc = gemflow_train(workspace_root, "full-faults", 2, FULL, background=True)
    _wait_for_checkpoint(ckpt, proc, min_step=10)
    rank1 = int((run / "ranks" / "rank-1.pid").read_text())
    os.kill(rank1, signal.SIGKILL)
    assert proc.wait(timeout=600) != 0
    first = (ckpt / "latest").read_text()
    assert first in ("step-00000010", "step-00000020")
    saved = json.loads((ckpt / first / "state.json").read_text())
    assert saved["fp8_gemm"] == "emulated" and saved["precision"] == "bf16"  # both kept on resume

    # 2. relaunch; rank 0 dies halfway through writing the next checkpoint
    next_step = int(first.removeprefix("step-")) + 10
    env = {CRASH_IN_CHECKPOINT: f"0:{next_step}"}
    proc = gemflow_train(workspace_root, "full-faults", 2, FULL, env=env, background=True, resume=True)
    assert proc.wait(timeout=1500) != 0
    assert (ckpt / f".step-{next_step:08d}.tmp").is_dir()  # the half-written checkpoint is there ...
    committed = (ckpt / "latest").read_text()  # `first`, or the best state's checkpoint at epoch 1's end
    assert first <= committed < f"step-{next_step:08d}"  # ... and nothing points at it
    assert not (ckpt / f"step-{next_step:08d}").exists()

    # 3. relaunch: resumes from the committed checkpoint, finishes, same result as never failing
    resumed = gemflow_train(workspace_root, "full-faults", 2, FULL, resume=True)
    log = (workspace_root / "full-faults.log").read_text()
    assert f"resumed from {committed}" in log
    assert not (ckpt / f".step-{next_step:08d}.tmp").exists()
    assert resumed["valid_ne"] == pytest.approx(unbroken_full["valid_ne"], rel=1e-9, abs=0)
    assert resumed["test_ne"] == pytest.approx(unbroken_full["test_ne"], rel=1e-9, abs=0)


def test_auto_zero_stage_runs_plain_data_parallel_and_resumes_it_exactly(workspace_root):
    """``distributed.zero_stage=auto`` takes ZeRO-0 for this small tower; a run that crashes while writing a
    checkpoint resumes from the committed one (ZeRO-0's whole optimizer state on every rank) to the NE of an
    unbroken run, and its checkpoints record the stage a resume must keep."""
    short = {"distributed.max_steps": 24}
    unbroken = gemflow_train(workspace_root, "auto-unbroken", 2, short)
    assert json.loads((workspace_root / "auto-unbroken" / "perf.json").read_text())["zero_stage"] == 0
    proc = gemflow_train(
        workspace_root, "auto-faults", 2, short, env={CRASH_IN_CHECKPOINT: "0:20"}, background=True
    )
    assert proc.wait(timeout=1500) != 0
    ckpt = workspace_root / "auto-faults" / "checkpoints"
    committed = (ckpt / "latest").read_text()
    assert committed < "step-00000020"
    assert json.loads((ckpt / committed / "state.json").read_text())["zero_stage"] == 0
    resumed = gemflow_train(workspace_root, "auto-faults", 2, short, resume=True)
    assert f"resumed from {committed}" in (workspace_root / "auto-faults.log").read_text()
    assert resumed["valid_ne"] == pytest.approx(unbroken["valid_ne"], rel=1e-9, abs=0)
    assert resumed["test_ne"] == pytest.approx(unbroken["test_ne"], rel=1e-9, abs=0)


def test_a_lock_left_by_a_killed_extension_build_does_not_hang_a_launch(workspace_root, tmp_path):
    """A launch killed while DeepSpeed JIT-compiled its shared-memory all-reduce left torch's build lock behind,
    and every later launch waited on it forever; training no longer builds that op."""
    extensions = tmp_path / "torch_extensions"
    (extensions / "deepspeed_shm_comm").mkdir(parents=True)
    (extensions / "deepspeed_shm_comm" / "lock").touch()
    env = {"TORCH_EXTENSIONS_DIR": str(extensions)}
    proc = gemflow_train(
        workspace_root, "stale-lock", 1, {"distributed.max_steps": 2}, env=env, background=True
    )
    try:
        rc = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the launch hung on the stale build lock")
    assert rc == 0, (workspace_root / "stale-lock.log").read_text()[-3000:]
    assert (workspace_root / "stale-lock" / "metrics.json").exists()


def test_bad_input_is_a_clear_error(workspace_root):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gemflow.cli",
            "train",
            "--model",
            "ranker",
            "--training-set",
            "learnable",
            "--workspace",
            str(workspace_root),
            "--nproc",
            "2",
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "runs the user model" in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gemflow.cli",
            "train",
            "--model",
            "user",
            "--training-set",
            "learnable",
            "--workspace",
            str(workspace_root),
            "--nproc",
            "3",
            "--set",
            "user_model.ffn=moe,moe",
            "--set",
            "distributed.moe.ep_size=2",
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "ep_size=2 must divide nproc=3" in proc.stderr
