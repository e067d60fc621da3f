"""One rank of a distributed user-model run (started N times by ``models.training.distributed.launch``).

    python -m models.training.distributed.trainer --config <run>/config.yaml --workspace <ws>

Per step: this rank's token-budget share of the global batch -> ids -> embeddings (large tables sharded by
torchrec DMP with fused row-wise Adagrad inside backward, small ones replicated: ``sparse.py``) -> DeepSpeed
engine over the dense tower (ZeRO, bf16, MoE experts across ranks, FP8 Linears) -> loss (+ MoE load-balancing loss) -> ``engine.backward`` -> ``engine.step``.
Every collective (sharded lookups, MoE all-to-all, the gradient reduction) needs all ranks, so every rank
runs the same number of steps and evaluation batches.

The epochs, evaluations, early stopping (``optim.patience``) and best-state tracking are the shared loop's
(``models.training.loop``, as in one process); ``DeepSpeedStrategy`` is what differs here. The best state is a checkpoint
kept from pruning; at the end it is loaded back into the engine, scored and exported as ``model.pt``.

Exact resume: the data plan is a function of (seed, epoch); the global RNG is re-seeded at every step from
(seed, step, rank) (the MoE gate's random token selection and the sampled negatives draw from it); a checkpoint
holds the sharded embeddings + their optimizer state, the engine, the step, the metric history and RNG states.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from gemflow.config import load_config
from gemflow.malloc import keep_freed_memory
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.training.distributed.batching import Step, example_costs, plan_epoch
from models.training.distributed.checkpoint import CheckpointStore
from models.training.distributed.engine import Parts, build
from models.training.distributed.evaluation import evaluate
from models.training.distributed.export import finish
from models.training.distributed.moe import moe_layers
from models.training.distributed.profiling import PROFILE_DIR, StepProfiler, write_perf
from models.training.distributed.run_checkpoint import RunState, load_checkpoint, save_checkpoint
from models.training.distributed.step import forward_loss, log_steps, step_seed, step_stats
from models.training.loop import LoopConfig, LoopState, run_loop

log = logging.getLogger("gemflow.distributed")


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
        tracker.record(run_dir)  # the run id registration resumes (models.tracking.registry)
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
            write_perf(p, run_dir, strategy.stats, cpu_by_rank, accounts)
        return finish(p, run_dir, store, state, tracker)
    except BaseException:
        if tracker is not None:
            tracker.end("FAILED")
        raise


class DeepSpeedStrategy:
    """One rank's side of the training loop (``models.training.loop``): a step through the sharded embeddings and the
    DeepSpeed engine, evaluation by all ranks together, checkpoints in the multi-rank ``CheckpointStore`` (the best
    state's kept from pruning: the export restores it). Steps re-seed the global RNG (exact resume)."""

    def __init__(self, p: Parts, plan: dict[int, list[Step]], store: CheckpointStore, tracker):
        self.p, self.plan, self.store, self.tracker = p, plan, store, tracker
        self.is_main = p.rank == 0
        self.num_dense = len(p.setup.bundle.dense.columns)
        self.recent: list[dict] = []  # step stats not logged yet
        self.stats: list[dict] = []  # every step this launch ran (perf.json)
        dc = p.cfg.distributed
        self.profiler = StepProfiler(
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
        stats = step_stats(p, step, loss.item(), parts, elapsed, self.num_dense)
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
            log_steps(self.p, self.tracker, self.recent, step)
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
            # ``log_steps``: the learning curve's train line (MLflow has it as train_loss every log_every steps)
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
        self.save_checkpoint(state)  # the store keeps it while it is the best: finish restores it

    def save_checkpoint(self, state: LoopState) -> None:
        if self.saved_step != state.step:  # the best state's checkpoint may also be the periodic one
            save_checkpoint(self.p, self.store, state)
            self.saved_step = state.step


def _tracker(cfg: TrainRunConfig, ws: Workspace, state: RunState, run_dir: Path):
    from models.tracking.training_run import Tracker
    from models.training.train import mlflow_run_name

    tracker = Tracker(cfg.tracking, ws, mlflow_run_name(cfg, run_dir), run_id=state.run_id)
    tracker.log_config(cfg)
    return tracker


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
    keep_freed_memory()  # no page faults on each step's large tensors (gemflow.malloc)
    try:
        run(cfg, Workspace(args.workspace.resolve()), args.run_dir.resolve())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
