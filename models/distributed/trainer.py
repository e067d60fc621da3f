"""One rank of a distributed user-model run (started N times by ``models.distributed.launch``).

    python -m models.distributed.trainer --config <run>/config.yaml --workspace <ws>

Per step: this rank's token-budget share of the global batch -> ids -> embeddings (large tables sharded by
torchrec DMP with fused row-wise Adagrad inside backward, small ones replicated: ``sparse.py``) -> DeepSpeed
engine over the dense tower (ZeRO, bf16, MoE experts across ranks, FP8 Linears) -> loss (+ MoE load-balancing loss) -> ``engine.backward`` -> ``engine.step``.
Every collective (sharded lookups, MoE all-to-all, the gradient reduction) needs all ranks, so every rank
runs the same number of steps and evaluation batches.

The epochs, evaluations, early stopping (``optim.patience``) and best-state tracking are the shared loop's
(``models.loop``, as in one process); ``DeepSpeedStrategy`` is what differs here. The best state is a checkpoint
kept from pruning; at the end it is loaded back into the engine, scored and exported as ``model.pt``.

Exact resume: the data plan is a function of (seed, epoch); the global RNG is re-seeded at every step from
(seed, step, rank) (the MoE gate's random token selection and the sampled negatives draw from it); a checkpoint
holds the sharded embeddings + their optimizer state, the engine, the step, the metric history and RNG states.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import record_function

from gemflow.config import load_config
from gemflow.workspace import Workspace
from models.compile import compile_dense, compile_seconds
from models.config import TrainRunConfig
from models.distributed import zero
from models.distributed.batching import Step, example_costs, plan_epoch
from models.distributed.checkpoint import CheckpointStore, load_state, save_state, weights_only_engine_loads
from models.distributed.config import validate_distributed
from models.distributed.ds_config import deepspeed_config
from models.distributed.fp8 import convert_to_float8
from models.distributed.fp8_gemm import figures, set_cpu_gemm, use_cpu_gemm
from models.distributed.mfu import mfu, user_model_flops
from models.distributed.model import DenseTower, ShardableSparse, cast_batch, sparse_ids, to_engine
from models.distributed.moe import export_state_dict, moe_aux_loss, moe_layers, swap_in_moe
from models.distributed.precision import dtype_of
from models.distributed.precision import resolve as resolve_precision
from models.distributed.sparse import SparseLookup
from models.distributed.step_account import account
from models.loop import LoopConfig, LoopState, run_loop
from models.malloc import keep_freed_memory
from models.metrics import binary_metrics
from models.row_buckets import bucket_linear_rows

log = logging.getLogger("gemflow.distributed")
# Fault injection for the crash-during-checkpoint test: this rank exits hard halfway through writing step N.
CRASH_IN_CHECKPOINT = "GEMFLOW_TEST_CRASH_IN_CHECKPOINT"  # "<rank>:<step>"
# Profiling: torch.profiler over steps [distributed.step_account_from, +PROFILE_STEPS) -> <dir>/rank-<r>.txt (op
# table) and a Chrome trace; where a step's time goes (embedding all-to-all, dense fwd/bwd, ZeRO reduce, optimizer)
PROFILE_DIR = "GEMFLOW_PROFILE_DIR"
PROFILE_STEPS = 4


@dataclass
class RunState(LoopState):
    """What a checkpoint restores besides the weights (saved as JSON): the loop's state and the run's layout."""

    left_out: int = 0  # trailing examples per epoch too few to give every rank one (logged, never silent)
    replicated_tables: list[str] = field(default_factory=list)  # the rest sharded (checkpoint layout)
    fp8_gemm: str = ""  # the float8 GEMM the run chose: a resume keeps it (the two paths round differently)
    precision: str = ""  # the dense tower's, "bf16" | "fp32": a resume keeps it (launch.run_precision)
    zero_stage: int | None = None  # the dense tower's: a resume keeps it (None: a checkpoint from before)


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
    setup: object  # models.train.Setup
    fp8_modules: list[str]
    fp8_gemm: str = ""  # the float8 GEMM that runs: "scaled_mm" | "emulated" ("" without float8)
    clock: PhaseClock = field(default_factory=PhaseClock)


# ----------------------------------------------------------------------------------------------- build
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

    from models.train import prepare

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
        # oneDNN compiles a kernel per GEMM shape: a few row counts (models.row_buckets), not new ones each step
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


# ----------------------------------------------------------------------------------------------- steps
def step_seed(seed: int, step: int, world: int, rank: int) -> int:
    return (seed * 1_000_003 + step * world + rank) % (2**63 - 1)


def forward_loss(p: Parts, rows: np.ndarray, global_examples: int):
    """(loss, parts of the loss) of this rank's share of one step.

    Token-balanced shares hold different example counts, and DeepSpeed averages the ranks' gradients; weighting
    this rank's mean loss by its share of the examples (x world) makes that average the global batch's mean,
    so N ranks take the step one rank would take on the whole batch.
    """
    from models.train import loss_fn

    clock = p.clock
    with clock("batch"):
        batch = p.setup.builder(rows).to(p.device)
        ids, negatives = sparse_ids(p.tower.model, batch)
    with clock("sparse_forward"):
        emb = to_engine(p.sparse(ids, batch.history.batch_size), p.world, p.dtype)
    with clock("dense_forward"):
        logits, aux = p.engine(emb, cast_batch(batch, p.dtype), negatives)
        share = len(rows) * p.world / global_examples
        loss = share * loss_fn(logits.float(), batch.labels, aux.float(), p.cfg)
    moe_aux = moe_aux_loss(p.tower)
    if moe_aux is not None:
        loss = loss + p.cfg.distributed.moe.aux_loss_weight * moe_aux
    return loss, {
        "next_event_loss": float(aux),
        "moe_aux_loss": float(moe_aux) if moe_aux is not None else 0.0,
    }


@torch.no_grad()
def engine_logits(p: Parts, rows: np.ndarray) -> torch.Tensor:
    """(N, 2) fp32 logits of the engine (in its current mode) on ``rows``; collective (sharded lookups, MoE)."""
    batch = p.setup.builder(rows).to(p.device)
    ids, _ = sparse_ids(p.tower.model, batch)
    emb = to_engine(p.sparse(ids, batch.history.batch_size), p.world, p.dtype)
    logits, _ = p.engine(emb, cast_batch(batch, p.dtype))
    return logits.float().cpu()


@torch.no_grad()
def evaluate(p: Parts, rows: np.ndarray, prefix: str) -> dict[str, float]:
    """Metrics over ``rows``, computed by all ranks together (each scores an equal share, then all-gather)."""
    if len(rows) == 0:
        return {}
    return _metrics(*predict(p, rows), prefix)


def _metrics(labels: np.ndarray, pred: np.ndarray, prefix: str) -> dict[str, float]:
    return {
        **binary_metrics(labels[:, 0], pred[:, 0], prefix),
        **binary_metrics(labels[:, 1], pred[:, 1], f"{prefix}conversion_"),
    }


def predict(p: Parts, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(labels, probabilities) of ``rows`` (click, conversion columns), in the order of ``rows`` on every rank.
    Collective: each rank scores an equal share, then all-gather."""
    engine = p.engine
    engine.eval()
    per_rank = math.ceil(len(rows) / p.world)
    padded = np.concatenate([rows, np.repeat(rows[:1], per_rank * p.world - len(rows))])  # equal shares
    mine = padded[p.rank * per_rank : (p.rank + 1) * per_rank]
    bs = p.cfg.optim.eval_batch_size
    probs = [torch.sigmoid(engine_logits(p, mine[start : start + bs])) for start in range(0, len(mine), bs)]
    engine.train()
    everyone = [None] * p.world
    dist.all_gather_object(everyone, torch.cat(probs).numpy())
    pred = np.concatenate(everyone)[: len(rows)]
    return p.setup.data.labels(rows).numpy(), pred


# ----------------------------------------------------------------------------------------------- checkpoints
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
        save_state(_rng_state(), folder / "rng" / f"rank-{p.rank}")
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
        _set_rng_state(load_state(rng))
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


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _maybe_crash(rank: int, step: int) -> None:
    spec = os.environ.get(CRASH_IN_CHECKPOINT, "")
    if spec and spec == f"{rank}:{step}":
        log.error("fault injection: rank %d exits halfway through checkpoint %d", rank, step)
        os._exit(17)


# ----------------------------------------------------------------------------------------------- the run
def schedule(p: Parts) -> tuple[dict[int, list[Step]], int]:
    """Every step of the run by epoch (the last cut to ``max_steps``), and the examples left out per epoch."""
    cfg, dc = p.cfg, p.cfg.distributed
    s = p.setup
    cuts = s.data.examples["cut"].to_numpy()[s.train_rows]
    costs = example_costs(cuts, cfg.user_model.max_history)
    out, total, left_out = {}, 0, 0
    for epoch in range(1, cfg.optim.epochs + 1):
        steps, left_out = plan_epoch(s.train_rows, costs, tokens_per_step=dc.tokens_per_step, world_size=p.world,
                                     seed=cfg.optim.seed, epoch=epoch)  # fmt: skip
        if dc.max_steps:
            steps = steps[: dc.max_steps - total]
        out[epoch], total = steps, total + len(steps)
        if dc.max_steps and total >= dc.max_steps:
            break
    return out, left_out


def run(cfg: TrainRunConfig, ws: Workspace, run_dir: Path) -> dict[str, float]:
    resumes = CheckpointStore(run_dir / "checkpoints", rank=0).latest() if cfg.resume else None
    p = build(cfg, ws, json.loads((resumes / "state.json").read_text()) if resumes is not None else None)
    dc = cfg.distributed
    rank0 = p.rank == 0
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    (run_dir / "ranks" / f"rank-{p.rank}.pid").write_text(str(os.getpid()))
    store = CheckpointStore(run_dir / "checkpoints", rank=p.rank, keep=dc.checkpoint.keep)
    if not cfg.resume:
        store.reset()
    store.remove_stale()
    state = RunState()
    latest = store.latest()
    if latest is not None:
        state = load_checkpoint(p, latest)
        if rank0:
            log.info("resumed from %s (step %d)", latest.name, state.step)

    plan, state.left_out = schedule(p)
    if rank0 and state.left_out:
        log.warning(
            "%d trailing train example(s) per epoch are left out: fewer than one per rank", state.left_out
        )
    tracker = _tracker(cfg, ws, state, run_dir) if rank0 else None
    if tracker is not None:
        state.run_id = tracker.run_id
        tracker.record(run_dir)  # the run id registration resumes (models.registry)
        tracker.log_training_set(p.setup.data)
        tracker.log_params({"nproc": p.world, "fp8_linears": len(p.fp8_modules), "fp8_gemm": p.fp8_gemm or "none", "moe_layers": len(moe_layers(p.tower)),
                            "steps": sum(map(len, plan.values())), "train_examples": len(p.setup.train_rows)})  # fmt: skip
    strategy = DeepSpeedStrategy(p, plan, store, tracker)
    loop = LoopConfig(cfg.optim.epochs, cfg.optim.patience, "valid_ne", higher_is_better=False,
                      eval_every=dc.eval_every, max_steps=dc.max_steps, checkpoint_every=dc.checkpoint.every_steps)  # fmt: skip
    try:
        p.engine.train()
        state = run_loop(strategy, loop, state)
        strategy.end(state)
        cpu_by_rank = [None] * p.world  # every rank's per-step CPU seconds: the critical path of each step
        dist.all_gather_object(cpu_by_rank, [r["cpu_seconds"] for r in strategy.stats])
        accounts = [None] * p.world  # every rank's step account (empty unless distributed.step_account)
        dist.all_gather_object(accounts, strategy.profiler.account)
        if rank0:
            _write_perf(p, run_dir, strategy.stats, cpu_by_rank, accounts)
        return _finish(p, run_dir, store, state, tracker)
    except BaseException:
        if tracker is not None:
            tracker.end("FAILED")
        raise


class DeepSpeedStrategy:
    """One rank's side of the training loop (``models.loop``): a step through the sharded embeddings and the
    DeepSpeed engine, evaluation by all ranks together, checkpoints in the multi-rank ``CheckpointStore`` (the best
    state's kept from pruning: the export restores it). Steps re-seed the global RNG (exact resume)."""

    def __init__(self, p: Parts, plan: dict[int, list[Step]], store: CheckpointStore, tracker):
        self.p, self.plan, self.store, self.tracker = p, plan, store, tracker
        self.is_main = p.rank == 0
        self.num_dense = len(p.setup.bundle.dense.columns)
        self.recent: list[dict] = []  # step stats not logged yet
        self.stats: list[dict] = []  # every step this launch ran (perf.json)
        dc = p.cfg.distributed
        self.profiler = _StepProfiler(
            os.environ.get(PROFILE_DIR), p.rank, dc.step_account, dc.step_account_from
        )
        self.saved_step = -1
        self.losses: list[float] = []  # this rank's step losses since the last evaluation

    def epoch_steps(self, epoch: int) -> list[Step]:
        return self.plan.get(epoch, [])

    def train_step(self, step: Step, i: int, epoch: int) -> float:
        p, oc = self.p, self.p.cfg.optim
        self.profiler.at_step(i)
        torch.manual_seed(step_seed(oc.seed, i, p.world, p.rank))
        start, cpu_start = time.perf_counter(), time.process_time()
        p.clock.reset()
        loss, parts = forward_loss(p, step.rows[p.rank], sum(len(r) for r in step.rows))
        with p.clock("backward"):
            p.engine.backward(loss)  # embedding rows are updated here by the fused Adagrad
        with p.clock("optimizer_step"):
            p.sparse.step()  # the replicated tables (the sharded ones were updated inside backward)
            p.engine.step()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        stats = _step_stats(p, step, loss.item(), parts, elapsed, self.num_dense)
        profiled = self.profiler.prof is not None  # profiler overhead: perf.json leaves the step out
        self.recent.append(stats | {"cpu_seconds": cpu, "profiled": profiled, **p.clock.as_dict()})
        self.stats.append(self.recent[-1])
        self.losses.append(stats["loss"])
        if (i + 1) % oc.log_every == 0:
            self.flush_logs(i + 1)
        return stats["loss"]

    def flush_logs(self, step: int) -> None:
        """Log the steps since the last log (collective: every rank calls it at the same steps)."""
        if self.recent:
            _log_steps(self.p, self.tracker, self.recent, step)
            self.recent = []

    def end(self, state: LoopState) -> None:
        self.profiler.stop()
        self.flush_logs(state.step)

    def evaluate(self, state: LoopState) -> dict[str, float]:
        metrics = {
            "step": state.step,
            "epoch": state.epoch,
            **evaluate(self.p, self.p.setup.valid_rows, "valid_"),
        }
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=state.step)
            if state.step:
                log.info("step %d: valid_ne %.4f", state.step, metrics["valid_ne"])
        if self.losses:  # the same on every rank (they run the same steps): a collective all take part in
            # the mean train loss since the last evaluation (after a resume: since the resume), over ranks as in
            # ``_log_steps``: the learning curve's train line (MLflow has it as train_loss every log_every steps)
            loss = torch.tensor([float(np.mean(self.losses))])
            dist.all_reduce(loss)
            metrics["train_loss"] = float(loss[0]) / self.p.world
            self.losses = []
        return metrics

    def agree(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def keep_best(self, state: LoopState) -> None:
        self.save_checkpoint(state)  # the store keeps it while it is the best: _finish restores it

    def save_checkpoint(self, state: LoopState) -> None:
        if self.saved_step != state.step:  # the best state's checkpoint may also be the periodic one
            save_checkpoint(self.p, self.store, state)
            self.saved_step = state.step


class _StepProfiler:
    """torch.profiler over a window of steps when ``GEMFLOW_PROFILE_DIR`` is set and/or ``step_account`` (the
    step account, kept in ``self.account``); neither: does nothing."""

    def __init__(self, folder: str | None, rank: int, step_account: bool = False, first_step: int = 4):
        self.folder, self.rank, self.prof = Path(folder) if folder else None, rank, None
        self.step_account, self.account, self.steps = step_account, {}, 0
        self.first_step = first_step

    def at_step(self, i: int) -> None:
        if self.folder is None and not self.step_account:
            return
        if i == self.first_step:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=self.folder is not None)
            self.prof.__enter__()
        elif i == self.first_step + PROFILE_STEPS:
            self.stop()
        if self.prof is not None:
            self.steps += 1  # steps started inside the window

    def stop(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        if self.step_account:
            self.account = account(self.prof.events(), max(self.steps, 1))
        if self.folder is None:
            self.prof = None
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        table = self.prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=100, max_name_column_width=70
        )
        (self.folder / f"rank-{self.rank}.txt").write_text(table)
        by_shape = self.prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60, max_shapes_column_width=120
        )
        (self.folder / f"rank-{self.rank}-shapes.txt").write_text(by_shape)
        self.prof.export_chrome_trace(str(self.folder / f"rank-{self.rank}.json"))
        self.prof = None


PERF_WARMUP_STEPS = 3  # the first steps pay for lazy initialisation and allocator warm-up


def _write_perf(
    p: Parts,
    run_dir: Path,
    stats: list[dict],
    cpu_by_rank: list[list[float]],
    accounts: list[dict] | None = None,
) -> None:
    """Throughput and MFU of this launch's steps after warm-up (what bench/train.py reads).

    Wall-clock figures, and the same in CPU time for a machine shared with other work (where wall time
    measures the neighbours): ``cpu_core_seconds`` is the CPU time of all ranks (model FLOPs per core-second
    against a 1-core peak give the MFU the cores reach while they run this job); ``critical_cpu_seconds`` sums,
    step by step, the CPU time of the slowest rank, the wall time the run would take on idle cores (minus
    communication latency), so tokens over it give the quiet-machine throughput.
    """
    first = PERF_WARMUP_STEPS if len(stats) > PERF_WARMUP_STEPS else 0
    # steps under the profiler (distributed.step_account) pay its overhead: left out of the figures
    kept = [i for i in range(first, len(stats)) if not stats[i].get("profiled")]
    timed = [stats[i] for i in kept]
    if not timed:
        return
    seconds = sum(r["seconds"] for r in timed)
    flops = sum(r["flops"] for r in timed)
    tokens = float(np.sum([r["tokens"] for r in timed]))
    cpu = np.array([[c[i] for i in kept] for c in cpu_by_rank])  # (ranks, steps)
    critical, core_seconds = float(cpu.max(0).sum()), float(cpu.sum())
    peak = p.cfg.distributed.peak_tflops * 1e12
    perf = {
        "nproc": p.world,
        "threads_per_rank": torch.get_num_threads(),
        "steps_timed": len(timed),
        "step_seconds_median": float(np.median([r["seconds"] for r in timed])),
        "tokens_per_second": tokens / seconds,
        "model_tflops_per_second": flops / seconds / 1e12,
        "peak_tflops": p.cfg.distributed.peak_tflops,
        "mfu": mfu(flops, seconds, peak),
        "token_imbalance_mean": float(np.mean([r["imbalance"] for r in timed])),
        "cpu_core_seconds": core_seconds,
        "critical_cpu_seconds": critical,
        "tokens_per_critical_cpu_second": tokens / critical if critical > 0 else float("nan"),
        "model_tflops_per_cpu_core_second": flops / core_seconds / 1e12 if core_seconds > 0 else float("nan"),
        "rank_cpu_imbalance_mean": float(np.mean(cpu.max(0) / cpu.mean(0))),
        # per timed step: the slowest rank's CPU seconds, and the wall seconds (the minimum is the figure least
        # disturbed by other work on a shared machine)
        "critical_cpu_seconds_per_step": [float(c) for c in cpu.max(0)],
        "step_seconds": [float(r["seconds"]) for r in timed],
        "precision": p.cfg.distributed.precision,  # the dense tower's, as distributed.precision=auto chose
        "zero_stage": int(p.cfg.distributed.zero_stage),  # as distributed.zero_stage=auto chose
        "fp8_linears": len(p.fp8_modules),
        "fp8_gemm": p.fp8_gemm,  # which float8 GEMM ran, and the probe's GFLOP/s when rank 0 measured it
        "fp8_gemm_gflops": figures() if p.fp8_gemm else None,
        "moe_layers": len(moe_layers(p.tower)),
        "compile": p.cfg.distributed.compile,
        # the first step (compiles when compile is on; the step-0 evaluation compiles the inference graphs),
        # and the compiler's own seconds (dynamo + inductor, this rank)
        "first_step_seconds": float(stats[0]["seconds"]),
        "compile_seconds": compile_seconds(),
        "step_account": accounts or [],  # per rank: models.distributed.step_account.account
        # rank 0's mean seconds per step in each phase (wall includes waiting for the other ranks)
        "phase_seconds_mean": {
            k: float(np.mean([r.get(k, 0.0) for r in timed]))
            for k in timed[0]
            if k.startswith(("wall_", "cpu_"))
        },
    }
    (run_dir / "perf.json").write_text(json.dumps(perf, indent=2))


def _step_stats(p: Parts, step: Step, loss: float, parts: dict, elapsed: float, num_dense: int) -> dict:
    """What one step did, for every rank (the plan is known everywhere; the loss is this rank's)."""
    cfg = p.cfg
    max_len = cfg.user_model.max_history
    cuts = p.setup.data.examples["cut"].to_numpy()
    lens = np.minimum(cuts[np.concatenate(step.rows)], max_len)
    flops = user_model_flops(cfg.user_model, lens, num_dense=num_dense, moe_top_k=cfg.distributed.moe.top_k)
    return {"loss": loss, **parts, "seconds": elapsed, "flops": flops, "tokens": list(step.tokens),
            "imbalance": step.imbalance, "examples": sum(len(r) for r in step.rows)}  # fmt: skip


def _log_steps(p: Parts, tracker, recent: list[dict], step: int) -> None:
    """Mean over the last steps: loss (averaged over ranks), throughput, MFU, tokens per rank."""
    local = torch.tensor([np.mean([r["loss"] for r in recent]), np.mean([r["moe_aux_loss"] for r in recent])])
    dist.all_reduce(local)
    local /= p.world
    seconds = sum(r["seconds"] for r in recent)
    tokens = np.sum([r["tokens"] for r in recent], axis=0)
    flops = sum(r["flops"] for r in recent)
    peak = p.cfg.distributed.peak_tflops * 1e12
    metrics = {
        "train_loss": float(local[0]),
        "moe_aux_loss": float(local[1]),
        "next_event_loss": float(np.mean([r["next_event_loss"] for r in recent])),
        "step_seconds": seconds / len(recent),
        "tokens_per_second": float(tokens.sum()) / seconds,
        "examples_per_second": sum(r["examples"] for r in recent) / seconds,
        "model_tflops_per_second": flops / seconds / 1e12,
        "mfu": mfu(flops, seconds, peak),
        "token_imbalance": float(np.mean([r["imbalance"] for r in recent])),
        **{f"tokens_rank{r}": float(t) / len(recent) for r, t in enumerate(tokens)},
    }
    if tracker is not None:
        tracker.log_metrics(metrics, step=step)
        log.info("step %d: %s", step, {k: round(v, 4) for k, v in metrics.items()})


def _tracker(cfg: TrainRunConfig, ws: Workspace, state: RunState, run_dir: Path):
    from models.tracking import Tracker
    from models.train import mlflow_run_name

    tracker = Tracker(cfg.tracking, ws, mlflow_run_name(cfg, run_dir), run_id=state.run_id)
    tracker.log_config(cfg)
    return tracker


EXPORT_CHECK_ROWS = 64  # validation examples the exported model is checked on against the engine


def export_model(p: Parts, run_dir: Path, state: RunState) -> float | None:
    """Write ``model.pt`` (rank 0): the standard bundle of ``models.inference``, loadable without DeepSpeed or
    torchrec. Full embedding tables gathered from their shards; MoE blocks as plain ``MixtureOfExperts`` with
    every rank's experts (``moe.export_state_dict``). Then the exported model is loaded back and scores a
    validation batch the engine also scores (eval mode): returns the largest |logit difference| (rank 0; None
    elsewhere or without validation rows). Collective: every rank calls it.
    """
    from models.inference import load_bundle, save_bundle

    tables = p.sparse.full_tables(p.rank)
    dense = {
        k.removeprefix("model."): v.detach().float().cpu() for k, v in p.engine.module.state_dict().items()
    }
    dense = export_state_dict(p.tower.model, dense, p.rank)
    rows = p.setup.valid_rows[:EXPORT_CHECK_ROWS]
    reference = None
    if len(rows):
        p.engine.eval()
        reference = engine_logits(p, rows)
        p.engine.train()
    if p.rank != 0:
        return None
    bundle = p.setup.bundle
    bundle.version = state.run_id or run_dir.name
    if moe_layers(p.tower):
        bundle.moe = {"num_experts": p.cfg.distributed.moe.num_experts, "top_k": p.cfg.distributed.moe.top_k}
    sparse = {f"sparse.{k}": v for k, v in tables.items()}
    save_bundle(run_dir / "model.pt", bundle, state_dict={**dense, **sparse})
    if reference is None:
        return None
    with torch.no_grad():
        exported, _ = load_bundle(run_dir / "model.pt").model(p.setup.builder(rows))
    diff = float((exported.float() - reference).abs().max())
    log.info("exported model.pt; max |logit - engine logit| on %d validation rows: %.2e (engine %s%s)",
             len(rows), diff, p.cfg.distributed.precision, ", fp8" if p.fp8_modules else "")  # fmt: skip
    return diff


def write_plots(
    run_dir: Path, history: list[dict], valid: tuple[np.ndarray, np.ndarray] | None
) -> list[Path]:
    """The plots a one-process run writes (``models.plots``, ``models.train.ClickTask.plots``): the learning
    curve of the run's evaluations, by step, and, given the best state's (labels, probabilities) on the valid
    split, its click calibration."""
    from models.plots import calibration_plot, learning_curve_plot

    plots = [learning_curve_plot(history, run_dir / "learning_curve.png", x="step")] if history else []
    if valid is not None:
        labels, pred = valid
        plots.append(calibration_plot(labels[:, 0], pred[:, 0], run_dir / "calibration.png"))
    return plots


def _finish(p: Parts, run_dir: Path, store: CheckpointStore, state: RunState, tracker) -> dict[str, float]:
    """The best state back in the engine, its validation + test metrics, the exported model, metrics.json and
    the plots; rank 0 writes and logs them."""
    best = store.path(state.best_step)
    if state.best_step != state.step and best.is_dir():  # not there: a run checkpointed before best tracking
        load_checkpoint(p, best)
        if p.rank == 0:
            log.info(
                "restored the best state (step %d, valid_ne %.4f) for export", state.best_step, state.best
            )
    final = {
        "steps": float(state.step),
        "best_step": float(state.best_step),
        "best_epoch": float(state.best_epoch),
    }
    valid = predict(p, p.setup.valid_rows) if len(p.setup.valid_rows) else None
    final |= _metrics(*valid, "valid_") if valid is not None else {}
    final |= evaluate(p, p.setup.test_rows, "test_")
    if state.history:
        final["initial_valid_ne"] = state.history[0]["valid_ne"]
    diff = export_model(p, run_dir, state)
    if diff is not None:
        final["export_max_abs_logit_diff"] = diff
    if p.rank == 0:
        (run_dir / "metrics.json").write_text(json.dumps(final, indent=2))
        (run_dir / "history.json").write_text(json.dumps(state.history, indent=2))
        plots = write_plots(run_dir, state.history, valid)
        if tracker is not None:
            tracker.log_metrics({f"final_{k}": v for k, v in final.items()}, step=state.step)
            tracker.mark_best(state.best_step)  # evaluations are logged at their global step
            for path in (*plots, *(run_dir / n for n in ("metrics.json", "history.json", "config.yaml"))):
                if path.exists():
                    tracker.log_artifact(path)
            tracker.end()
    dist.barrier()
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", required=True, type=Path, help="the run's config.yaml (written by the launcher)"
    )
    parser.add_argument("--workspace", required=True, type=Path)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    from gemflow import logs

    logs.setup(fmt=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(message)s", force=True)
    cfg = load_config(TrainRunConfig, args.config)
    keep_freed_memory()  # no page faults on each step's large tensors (models.malloc)
    try:
        run(cfg, Workspace(args.workspace.resolve()), args.run_dir.resolve())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
