"""A rank's model and DeepSpeed engine: the process group, the run's precision (rank 0's choice when ``auto``),
the user model's sparse tables behind ``SparseLookup`` (sharded by torchrec DMP or replicated) and its dense tower
(MoE swapped in, FP8 Linears, bucketed row counts for bf16 on CPU, compiled) inside ``deepspeed.initialize``
(ZeRO stage resolved, or kept from the checkpoint the run resumes). ``Parts`` is everything a step needs."""

from __future__ import annotations

import importlib
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.profiler import record_function

from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.inference.compile import compile_dense
from models.inference.row_buckets import bucket_linear_rows
from models.training.distributed import zero
from models.training.distributed.config import validate_distributed
from models.training.distributed.ds_config import deepspeed_config
from models.training.distributed.fp8 import convert_to_float8
from models.training.distributed.fp8_gemm import set_cpu_gemm, use_cpu_gemm
from models.training.distributed.model import DenseTower, ShardableSparse
from models.training.distributed.moe import swap_in_moe
from models.training.distributed.precision import dtype_of
from models.training.distributed.precision import resolve as resolve_precision
from models.training.distributed.sparse import SparseLookup

log = logging.getLogger("gemflow.distributed")


class PhaseClock:
    """Wall and CPU seconds of the named phases of one step (perf.json's breakdown), each also a profiler span."""

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def reset(self) -> None:
        self.wall, self.cpu = {}, {}

    @contextmanager
    def __call__(self, name: str):
        wall, cpu = time.perf_counter(), time.process_time()
        with record_function(f"gemflow.{name}"):
            yield
        self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - wall
        self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - cpu

    def as_dict(self) -> dict[str, float]:
        return {f"wall_{k}": v for k, v in self.wall.items()} | {f"cpu_{k}": v for k, v in self.cpu.items()}


@dataclass
class Parts:
    cfg: TrainRunConfig
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    sparse: SparseLookup  # sharded (DMP) + replicated embedding tables
    engine: object
    tower: DenseTower
    setup: object  # models.training.train.Setup
    fp8_modules: list[str]
    fp8_gemm: str = ""  # the float8 GEMM that runs: "scaled_mm" | "emulated" ("" without float8)
    clock: PhaseClock = field(default_factory=PhaseClock)


def _backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def skip_shared_memory_all_reduce() -> None:
    """Keep DeepSpeed from JIT-building its CPU shared-memory all-reduce at ``init_distributed``.

    That op serves only ``inference_all_reduce``, which training never calls. Building it is a C++ compile (a
    minute or two on a fresh machine) under torch's file lock, and a launch killed during the compile leaves the
    lock behind: every later launch then waited on it forever, printing nothing.
    """
    # by module name: the attribute ``deepspeed.comm.torch`` is the torch package (re-exported by a star import)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def build(cfg: TrainRunConfig, ws: Workspace, resumed: dict | None = None) -> Parts:
    """Every rank's model, engine and lookups; ``resumed``: the state.json of the checkpoint the run continues
    from (its ZeRO stage is kept)."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from models.training.prepare import prepare

    dc = cfg.distributed
    validate_distributed(dc, cfg.user_model.ffn, cfg.user_model.num_layers)
    if cfg.model != "user":
        raise ValueError(f"distributed training runs the user model; got model={cfg.model!r}")
    skip_shared_memory_all_reduce()
    deepspeed.init_distributed(dist_backend=_backend(dc.backend))
    rank, world = dist.get_rank(), dist.get_world_size()
    if dc.precision == "auto":  # the launcher resolves it; ranks started another way agree on rank 0's choice
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        chosen = [resolve_precision("auto", device_type)[0] if rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        cfg = replace(cfg, distributed=replace(dc, precision=chosen[0]))
        dc = cfg.distributed
    if "moe" in cfg.user_model.ffn and world % dc.moe.ep_size:
        raise ValueError(f"distributed.moe.ep_size={dc.moe.ep_size} must divide the world size {world}")
    device = (
        torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = dtype_of(dc.precision)

    setup = prepare(cfg, ws)  # seeds every RNG from optim.seed: the same initial model on every rank
    model = setup.bundle.model
    sparse = ShardableSparse(model.sparse, cfg.user_model.d_model)
    if cfg.user_model.ffn:
        swap_in_moe(model.blocks, cfg.user_model.ffn, dc.moe, rank=rank, seed=cfg.optim.seed)
    tower = DenseTower(model)
    fp8_modules = convert_to_float8(tower, dc.fp8)
    if device.type == "cpu" and dtype == torch.bfloat16 and dc.compile == "off":
        # oneDNN compiles a kernel per GEMM shape: a few row counts (models.inference.row_buckets), not new ones each step
        swapped = bucket_linear_rows(tower)
        if rank == 0:
            log.info("%d linear layers run on bucketed row counts (bf16 on CPU)", swapped)
    compile_dense(tower.model, dc.compile)  # after FP8: compiled regions call whatever Linears are in place
    comm = dc.sparse_comm
    if comm == "auto":
        comm = "bf16" if device.type == "cuda" and dc.precision == "bf16" else "fp32"
    lookup = SparseLookup(sparse, cfg.user_model.d_model, sharding=dc.sharding, world=world, device=device,
                          replicate_max_rows=dc.replicate_max_rows, lr=cfg.optim.sparse_lr, comm=comm)  # fmt: skip
    tower.to(device)

    trained = [p for p in tower.parameters() if p.requires_grad]
    n_trained = sum(p.numel() for p in trained)
    stage = zero.resolve(dc.zero_stage, n_trained, world, resumed)
    if rank == 0 and dc.zero_stage == "auto":
        log.info("ZeRO stage %d (distributed.zero_stage=auto: %.0f MiB of optimizer state, %d rank(s)%s)", stage,
                 n_trained * zero.STATE_BYTES_PER_PARAMETER / 2**20, world,
                 ", as its checkpoint" if resumed is not None else "")  # fmt: skip
    cfg = replace(cfg, distributed=replace(dc, zero_stage=str(stage)))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": trained, "name": "dense"})
    engine, *_ = deepspeed.initialize(
        model=tower, model_parameters=groups, config=deepspeed_config(cfg, world)
    )
    fp8_gemm = _fp8_gemm(dc.fp8.cpu_gemm, device, rank) if fp8_modules else ""
    return Parts(cfg, rank, world, device, dtype, lookup, engine, tower, setup, fp8_modules, fp8_gemm)


def _fp8_gemm(mode: str, device: torch.device, rank: int) -> str:
    """The float8 GEMM path: on CPU rank 0 chooses (measured once) and every rank adopts it, so ranks agree."""
    if device.type != "cpu":
        return "scaled_mm"
    path = [use_cpu_gemm(mode) if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    set_cpu_gemm(path[0])
    return path[0]
