"""What one rank writes into a checkpoint of ``CheckpointStore`` and reads back at a resume: the engine, the
sharded embeddings (torch.distributed.checkpoint) and their optimizer state, the replicated tables, its RNG
states, and ``RunState`` (the loop's state and the run's layout). A resume refuses a layout it cannot continue:
another table split, precision or ZeRO stage."""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from models.training.distributed import zero
from models.training.distributed.checkpoint import (
    CheckpointStore,
    load_state,
    save_state,
    weights_only_engine_loads,
)
from models.training.distributed.engine import Parts
from models.training.distributed.fp8_gemm import set_cpu_gemm
from models.training.loop import LoopState

log = logging.getLogger("gemflow.distributed")


# Fault injection for the crash-during-checkpoint test: this rank exits hard halfway through writing step N.
CRASH_IN_CHECKPOINT = "GEMFLOW_TEST_CRASH_IN_CHECKPOINT"  # "<rank>:<step>"


@dataclass
class RunState(LoopState):
    """What a checkpoint restores besides the weights (saved as JSON): the loop's state and the run's layout."""

    left_out: int = 0  # trailing examples per epoch too few to give every rank one (logged, never silent)
    replicated_tables: list[str] = field(default_factory=list)  # the rest sharded (checkpoint layout)
    fp8_gemm: str = ""  # the float8 GEMM the run chose: a resume keeps it (the two paths round differently)
    precision: str = ""  # the dense tower's, "bf16" | "fp32": a resume keeps it (launch.run_precision)
    zero_stage: int | None = None  # the dense tower's: a resume keeps it (None: a checkpoint from before)


def save_checkpoint(p: Parts, store: CheckpointStore, state: RunState) -> Path:
    import torch.distributed.checkpoint as dcp

    state.replicated_tables = p.sparse.replicated_tables
    state.fp8_gemm = p.fp8_gemm
    state.precision = p.cfg.distributed.precision
    state.zero_stage = int(p.cfg.distributed.zero_stage)

    def write(folder: Path) -> None:
        p.engine.save_checkpoint(str(folder / "dense"), tag="engine", save_latest=False)
        _maybe_crash(p.rank, state.step)
        dmp = p.sparse.dmp
        if dmp is not None:
            dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()},
                     checkpoint_id=str(folder / "sparse"))  # fmt: skip
        if p.rank == 0:  # the same on every rank
            save_state(p.sparse.replicated_state(), folder / "replicated")
        (folder / "rng").mkdir(exist_ok=True)
        save_state(rng_state(), folder / "rng" / f"rank-{p.rank}")
        if p.rank == 0:
            (folder / "state.json").write_text(json.dumps(state.__dict__, indent=1))

    return store.save(state.step, write, protect=state.best_step)


def load_checkpoint(p: Parts, path: Path) -> RunState:
    import torch.distributed.checkpoint as dcp

    state = RunState(**json.loads((path / "state.json").read_text()))
    check_table_split(state.replicated_tables, p.sparse.replicated_tables, path)
    check_precision(state.precision, p.cfg.distributed.precision, path)
    zero.check(state.zero_stage, int(p.cfg.distributed.zero_stage), path)
    if p.device.type == "cpu" and p.fp8_gemm and state.fp8_gemm:
        set_cpu_gemm(state.fp8_gemm)  # what the probe chose now may differ: continue as the run began
        p.fp8_gemm = state.fp8_gemm
    with weights_only_engine_loads(p.engine):
        p.engine.load_checkpoint(str(path / "dense"), tag="engine")
    dmp = p.sparse.dmp
    if dmp is not None:
        sd = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
        dcp.load(sd, checkpoint_id=str(path / "sparse"))
        dmp.load_state_dict(sd["model"])
        dmp.fused_optimizer.load_state_dict(sd["optim"])
    if state.replicated_tables:
        p.sparse.load_replicated_state(load_state(path / "replicated"))
    rng = path / "rng" / f"rank-{p.rank}"
    if rng.with_suffix(".json").exists():  # the same world size: restore exactly (steps re-seed anyway)
        set_rng_state(load_state(rng))
    return state


def check_table_split(saved: list[str], current: list[str], path: Path) -> None:
    """A checkpoint holds the replicated tables in one file and the sharded ones in another: resuming needs the
    same split (``distributed.replicate_max_rows``)."""
    if sorted(saved) != sorted(current):
        raise ValueError(
            f"checkpoint {path} holds replicated tables {sorted(saved)} but this run replicates {sorted(current)}: "
            "resume with the distributed.replicate_max_rows it was written with (checkpoints from before "
            "replicated tables existed: 0), or start fresh with resume=false"
        )


def check_precision(saved: str, current: str, path: Path) -> None:
    """DeepSpeed's bf16 and fp32 engine states differ: a resume runs in the precision it was written in."""
    if saved and saved != current:
        raise ValueError(
            f"checkpoint {path} was written by a {saved} run but this run is {current}: resume with "
            f"distributed.precision={saved} (or auto), or start fresh with resume=false"
        )


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _maybe_crash(rank: int, step: int) -> None:
    spec = os.environ.get(CRASH_IN_CHECKPOINT, "")
    if spec and spec == f"{rank}:{step}":
        log.error("fault injection: rank %d exits halfway through checkpoint %d", rank, step)
        os._exit(17)
