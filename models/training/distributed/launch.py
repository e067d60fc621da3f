"""Start a distributed user-model run: ``gemflow train --model user --nproc N`` ends up here.

The launcher validates the config, writes it into the run folder (every rank reads that file, so all ranks
run the same config and the run records what it used), measures the machine's matmul peak for MFU when the
config does not give one, and starts N ranks of ``models.training.distributed.trainer`` with torchrun (default) or the
DeepSpeed CLI; the ranks never outlive the launcher, however it ends (``models.training.distributed.orphans``). On a CPU
machine DeepSpeed runs with ``DS_ACCELERATOR=cpu`` over gloo; on GPUs the same entry point uses NCCL.
``TORCH_EXTENSIONS_DIR`` points at a kept cache so an op DeepSpeed JIT-builds is
compiled once, not at every launch.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path

import torch

from gemflow.config import save_config
from gemflow.processes import run_in_own_group
from gemflow.workspace import Workspace
from models.config import TrainRunConfig, validate
from models.training.distributed.config import validate_distributed
from models.training.distributed.orphans import launcher_env

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[3]
RANK_MODULE = "models.training.distributed.rank"  # the trainer behind a watchdog on this process


class DistributedRunError(RuntimeError):
    """The distributed job exited with an error (a rank failed or was killed)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(nproc: int, base: dict[str, str] | None = None, threads: int = 0) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    # the cores are shared by the ranks: N ranks x (cores / N) threads, never N x cores
    env["OMP_NUM_THREADS"] = str(threads or max(1, (os.cpu_count() or 1) // nproc))
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def command(cfg: TrainRunConfig, config_path: Path, ws: Workspace, run_dir: Path) -> list[str]:
    dc = cfg.distributed
    port = dc.master_port or free_port()
    rank_args = ["--config", str(config_path), "--workspace", str(ws.root), "--run-dir", str(run_dir)]
    if dc.launcher == "deepspeed":
        ds = Path(sys.executable).with_name("deepspeed")
        return [str(ds), f"--num_gpus={dc.nproc}", "--no_local_rank", f"--master_port={port}",
                "--module", RANK_MODULE, *rank_args]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={dc.nproc}",
            f"--master_port={port}", "--max_restarts=0", "-m", RANK_MODULE, *rank_args]  # fmt: skip


def peak_tflops(precision: str) -> float:
    """This machine's dense GEMM peak in the run's precision, on all cores (quick: ~1 s)."""
    from models.training.distributed.mfu import measure_matmul_peak
    from models.training.distributed.precision import dtype_of

    return measure_matmul_peak(dtype_of(precision), size=1024, seconds=1.0) / 1e12


def run_precision(cfg: TrainRunConfig, run_dir: Path) -> str:
    """``distributed.precision=auto`` made concrete: the precision of the checkpoint a resume continues from,
    else what this machine multiplies fastest (``models.training.distributed.precision``)."""
    from models.training.distributed.checkpoint import CheckpointStore
    from models.training.distributed.precision import resolve

    latest = CheckpointStore(run_dir / "checkpoints", rank=0).latest() if cfg.resume else None
    if latest is not None and (latest / "state.json").exists():
        saved = json.loads((latest / "state.json").read_text()).get("precision")
        if saved:
            log.info("dense tower precision: %s (resuming %s)", saved, latest.name)
            return saved
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve("auto", device)[0]


def launch(cfg: TrainRunConfig, ws: Workspace, *, env: dict[str, str] | None = None) -> Path:
    """Run the job to completion; returns the run folder (metrics.json, model.pt, checkpoints/)."""
    from models.training.data import TrainingSetError
    from models.training.prepare import resolve_training_set
    from models.training.train import run_dir_for

    validate(cfg)
    if cfg.model != "user":
        raise ValueError(f"--nproc runs the user model on DeepSpeed; got model={cfg.model!r}")
    validate_distributed(cfg.distributed, cfg.user_model.ffn, cfg.user_model.num_layers)
    # resolve here, where the caller's working directory means something: the ranks run from the repository
    training_set = resolve_training_set(cfg.training_set, ws).resolve()
    for name in ("sequences.parquet", "examples.parquet"):
        if not (training_set / name).exists():
            raise TrainingSetError(f"{training_set} is not a training set: {name} is missing")
    run_dir = run_dir_for(cfg, ws).resolve()
    cfg = replace(cfg, training_set=str(training_set))
    if cfg.distributed.precision == "auto":
        cfg = replace(cfg, distributed=replace(cfg.distributed, precision=run_precision(cfg, run_dir)))
    if not cfg.distributed.peak_tflops and not torch.cuda.is_available():
        cfg = replace(
            cfg, distributed=replace(cfg.distributed, peak_tflops=peak_tflops(cfg.distributed.precision))
        )
    config_path = save_config(cfg, run_dir)
    cmd = command(cfg, config_path, ws, run_dir)
    log.info("launching %d rank(s): %s", cfg.distributed.nproc, " ".join(cmd))
    rank_env = {**launch_env(cfg.distributed.nproc, env, cfg.distributed.threads_per_rank), **launcher_env()}
    returncode = run_in_own_group(cmd, env=rank_env, cwd=REPO)
    if returncode:
        raise DistributedRunError(
            f"distributed training exited with {returncode} (a rank failed or was killed); rerun the same "
            f"command with --resume to continue from the latest checkpoint in {run_dir / 'checkpoints'}"
        )
    return run_dir
