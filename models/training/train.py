"""Single-process training of the user model or the ranker (``gemflow train --model user|ranker``).

One loop, two tasks (``Task``): what a batch is, its loss, and how a split is judged.
- ``ClickTask`` (labelled impressions; the user model's click objective and the ranker): one epoch is a shuffled
  pass over the train examples; the best epoch is the lowest validation click NE.
- ``NextItemTask`` (``models.sequential``; positive-only logs split leave-one-out; the user model's next-item
  objective and the SASRec baseline): one epoch is one train prefix per user; the best epoch is the highest
  validation NDCG@10 of the leave-one-out protocol (NE is undefined without negatives).
One epoch = one pass (order fixed by ``seed + epoch``), then an evaluation on the valid split; early stopping
after ``optim.patience`` epochs without improvement (the loop is ``models.training.loop``'s, shared with ``--nproc``
training; ``LocalStrategy`` is this process's side of it). Sparse embedding rows are updated by a fused row-wise
Adagrad inside backward (torchrec ``apply_optimizer_in_backward``), dense parameters by AdamW; the next-item
task trains its embeddings with AdamW too (under row-wise Adagrad at the click task's rates they barely left
their random start).
A checkpoint (model, both optimizers, epoch/step, RNG, early-stopping state, MLflow run id) is written
atomically after every epoch; rerunning the command with ``--resume`` continues from it (without, it trains a new run
in a new folder; ``models.training.run_folder``). Outputs in the run folder:
``model.pt`` (best weights), ``checkpoint.pt``, ``config.yaml``, ``metrics.json``, ``history.json``, plots.
What a run trains on is ``models.training.prepare``'s, its optimizers ``models.training.optimizers``', its end ``models.training.finish``'s.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gemflow.config import save_config
from gemflow.workspace import Workspace
from models.config import TrainRunConfig, validate
from models.inference.bundle import (
    atomic_save,
    batches,
    load_bundle,
    predict,
    save_bundle,
)
from models.tracking.training_run import Tracker
from models.training import run_folder
from models.training.finish import final_metrics, head_metrics, record, write_plots
from models.training.loop import LoopConfig, LoopState, run_loop
from models.training.optimizers import (
    load_sparse_optimizer_state,
    make_optimizers,
    scheduled_lr,
    sparse_optimizer_state,
)
from models.training.prepare import Setup, prepare, resolve_objective, resolve_training_set, seed_everything

log = logging.getLogger(__name__)
CHECKPOINT = "checkpoint.pt"
# the best state by the next-item task's second metric (``next_item.also_select_metric``)
ALSO_MODEL = "model-also.pt"


@dataclass
class TrainResult:
    run_dir: Path
    metrics: dict[str, float]  # final: valid_* and test_* of the best epoch
    history: list[dict[str, float]]  # one entry per evaluation (epoch 0 = the untrained model)
    best_epoch: int
    mlflow_run_id: str | None


def loss_fn(
    logits: torch.Tensor, labels: torch.Tensor, aux: torch.Tensor, cfg: TrainRunConfig
) -> torch.Tensor:
    click = F.binary_cross_entropy_with_logits(logits[:, 0], labels[:, 0])
    conversion = F.binary_cross_entropy_with_logits(logits[:, 1], labels[:, 1])
    aux_weight = cfg.user_model.next_event_weight if cfg.model == "user" else 0.0
    return click + cfg.optim.conversion_weight * conversion + aux_weight * aux


def evaluate_rows(model, builder, rows, batch_size, prefix: str) -> dict[str, float]:
    if len(rows) == 0:
        return {}
    rows = builder.grouped(rows)  # snapshot groups contiguous: each user-day history is encoded once
    return head_metrics(builder.data.labels(rows).numpy(), predict(model, builder, rows, batch_size), prefix)


def default_run_name(cfg: TrainRunConfig) -> str:
    return cfg.tracking.run_name or f"{cfg.model}-{Path(cfg.training_set).name}"


def mlflow_run_name(cfg: TrainRunConfig, run_dir: Path) -> str:
    """The MLflow run's name: as configured, else the default folder's name (``user-fx-2`` for a second run)."""
    return cfg.tracking.run_name or (default_run_name(cfg) if cfg.output_dir else run_dir.name)


def run_dir_for(cfg: TrainRunConfig, ws: Workspace) -> Path:
    """The folder this invocation trains in, checked for a resume (``models.training.run_folder``); writes nothing."""
    run_dir = run_folder.choose(cfg, ws, default_run_name(cfg))
    if cfg.resume:
        run_folder.check_resume(cfg, run_dir, lambda a, b: _same_set(a, b, ws))
    return run_dir


def _same_set(a: str, b: str, ws: Workspace) -> bool:
    return a == b or resolve_training_set(a, ws).resolve() == resolve_training_set(b, ws).resolve()


class ClickTask:
    """Labelled impressions: click (+ conversion) heads, judged by validation click NE (lower is better)."""

    select, higher_is_better, sparse_in_backward = "valid_ne", False, True
    also = ""  # no second kept state

    def __init__(self, cfg: TrainRunConfig, setup: Setup):
        self.cfg, self.setup, self.bundle = cfg, setup, setup.bundle
        self.rows = {"train": setup.train_rows, "valid": setup.valid_rows, "test": setup.test_rows}
        self.num_train = len(setup.train_rows)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        rng = np.random.default_rng(self.cfg.optim.seed + epoch)
        return list(
            batches(self.setup.builder.epoch_order(self.setup.train_rows, rng), self.cfg.optim.batch_size)
        )

    def loss(self, rows: np.ndarray) -> torch.Tensor:
        batch = self.setup.builder(rows)
        logits, aux = self.bundle.model(batch)
        return loss_fn(logits, batch.labels, aux, self.cfg)

    def evaluate(self, model: nn.Module, split: str, epoch: int | None = None) -> dict[str, float]:
        return evaluate_rows(
            model, self.setup.builder, self.rows[split], self.cfg.optim.eval_batch_size, f"{split}_"
        )

    def plots(self, model: nn.Module, history: list[dict], run_dir: Path) -> list[Path]:
        valid_rows = self.setup.builder.grouped(self.setup.valid_rows)
        probs = predict(model, self.setup.builder, valid_rows, self.cfg.optim.eval_batch_size)
        return write_plots(run_dir, history, (self.setup.data.labels(valid_rows).numpy(), probs))


def make_task(cfg: TrainRunConfig, ws: Workspace, user_embeddings: np.ndarray | None = None):
    """The task a run trains for: the next-item task for a user model (or SASRec) on a leave-one-out set whose
    objective resolves to ``next_item``, else the click task."""
    path = resolve_training_set(cfg.training_set, ws)
    if cfg.model == "sasrec" or (cfg.model == "user" and resolve_objective(cfg, path) == "next_item"):
        from models.sequential.task import NextItemTask

        validate(cfg)
        seed_everything(cfg.optim.seed)
        return NextItemTask(cfg, path)
    return ClickTask(cfg, prepare(cfg, ws, user_embeddings))


class LocalStrategy:
    """One process's side of the training loop (``models.training.loop``): a plain optimizer step (fused row-wise
    Adagrad in backward + AdamW with the lr schedule), ``model.pt`` rewritten whenever the state improves,
    ``checkpoint.pt`` after every evaluation."""

    is_main = True

    def __init__(self, task, cfg: TrainRunConfig, run_dir: Path):
        self.task, self.oc, self.run_dir = task, cfg.optim, run_dir
        self.tracker: Tracker | None = None  # set once a resume has named the MLflow run to continue
        self.model = task.bundle.model
        self.sparse, self.dense_opt = make_optimizers(
            self.model, cfg.optim, sparse_in_backward=task.sparse_in_backward
        )
        self.total_steps = self.oc.epochs * math.ceil(task.num_train / self.oc.batch_size)  # the lr horizon
        self.losses: list[torch.Tensor] = []  # since the last evaluation (detached, read back in bulk)
        self.started = time.perf_counter()

    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT

    def resume(self) -> LoopState | None:
        path = self.checkpoint_path()
        if not path.exists():
            return None
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        try:
            self.model.load_state_dict(ckpt["model"])
        except RuntimeError as err:  # a checkpoint of another shape that the config check could not see
            first = str(err).strip().splitlines()[-1].strip()
            raise run_folder.ResumeRefused(f"cannot resume {path}: it holds another model ({first})") from err
        self.dense_opt.load_state_dict(ckpt["optimizer"])
        load_sparse_optimizer_state(self.sparse, ckpt["sparse_optimizer"])
        torch.set_rng_state(ckpt["rng"])
        return loop_state(ckpt["state"])

    def epoch_steps(self, epoch: int) -> list[np.ndarray]:
        return self.task.epoch_batches(epoch)

    def train_step(self, batch: np.ndarray, step: int, epoch: int) -> float | None:
        oc = self.oc
        if not self.losses:  # an epoch begins
            self.model.train()
            self.started = time.perf_counter()
        loss = self.task.loss(batch)
        self.dense_opt.zero_grad(set_to_none=True)
        loss.backward()  # embedding rows are updated here by the fused Adagrad (click task)
        if oc.grad_clip > 0:
            nn.utils.clip_grad_norm_(
                [p for g in self.dense_opt.param_groups for p in g["params"]], oc.grad_clip
            )
        for group in self.dense_opt.param_groups:
            group["lr"] = scheduled_lr(oc.lr, step, self.total_steps, oc)
        self.dense_opt.step()
        # no per-step host sync: the losses stay tensors and are read back once per log_every steps (the
        # loop checks that value for NaN / inf) and at the evaluation
        self.losses.append(loss.detach())
        if (step + 1) % oc.log_every:
            return None
        recent = float(torch.stack(self.losses[-oc.log_every :]).mean())
        self.tracker.log_metrics({"train_loss": recent}, step=step + 1)
        return recent

    def evaluate(self, state: LoopState) -> dict[str, float]:
        if not state.history:  # epoch 0: the untrained model
            metrics = {"epoch": 0, **self.task.evaluate(self.model, "valid", epoch=0)}
            self.tracker.log_metrics(metrics, step=0)
            return metrics
        metrics = {
            "epoch": state.epoch,
            "train_loss": float(torch.stack(self.losses).mean()) if self.losses else math.nan,
        }
        trained = time.perf_counter()
        metrics |= self.task.evaluate(self.model, "valid", epoch=state.epoch)
        metrics |= {"train_seconds": trained - self.started, "eval_seconds": time.perf_counter() - trained}
        self.losses = []
        self.tracker.log_metrics(metrics, step=state.epoch)
        log.info("epoch %d: %s", state.epoch, {k: round(v, 4) for k, v in metrics.items()})
        return metrics

    def agree(self, value):
        return value

    def keep_best(self, state: LoopState) -> None:
        save_bundle(self.run_dir / "model.pt", self.task.bundle)

    def keep_also(self, state: LoopState) -> None:
        save_bundle(self.run_dir / ALSO_MODEL, self.task.bundle)

    def save_checkpoint(self, state: LoopState) -> None:
        atomic_save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.dense_opt.state_dict(),
                "sparse_optimizer": sparse_optimizer_state(self.sparse),
                "rng": torch.get_rng_state(),
                "state": asdict(state),
            },
            self.checkpoint_path(),
        )


def loop_state(saved: dict) -> LoopState:
    """The loop state of a checkpoint, also one written before the shared loop (``best_ne``, ``bad_epochs``)."""
    renamed = {"best_ne": "best", "bad_epochs": "bad_evals"}
    return LoopState(**{renamed.get(k, k): v for k, v in saved.items()})


def train(cfg: TrainRunConfig, ws: Workspace, user_embeddings: np.ndarray | None = None) -> TrainResult:
    run_dir = run_dir_for(cfg, ws)  # refuses a resume with another config before anything is built or written
    task = make_task(cfg, ws, user_embeddings)
    strategy = LocalStrategy(task, cfg, run_dir)
    state = (strategy.resume() if cfg.resume else None) or LoopState()
    if state.step or state.history:
        log.info("resumed %s at epoch %d step %d", run_dir, state.epoch, state.step)
    else:
        log.info("new run in %s", run_dir)
    save_config(cfg, run_dir)  # only now: the model (and any checkpoint it resumes) has loaded

    tracker = Tracker(cfg.tracking, ws, mlflow_run_name(cfg, run_dir), run_id=state.run_id)
    strategy.tracker = tracker
    state.run_id = tracker.run_id
    tracker.record(run_dir)  # the run id registration resumes (models.tracking.registry)
    task.bundle.version = tracker.run_id or run_dir.name
    tracker.log_config(cfg)
    if isinstance(task, ClickTask):
        tracker.log_training_set(task.setup.data)
    tracker.log_params({"train_examples": task.num_train, "selection_metric": task.select,
                        "dense_features": ",".join(task.bundle.dense.columns) or "-"})  # fmt: skip
    if task.bundle.user_model_version:
        tracker.set_tags({"user_model_version": task.bundle.user_model_version})

    loop = LoopConfig(
        cfg.optim.epochs, cfg.optim.patience, task.select, task.higher_is_better, also=task.also
    )
    try:
        state = run_loop(strategy, loop, state)
        result = _finish(task, run_dir, state, tracker)
    except BaseException:
        tracker.end("FAILED")
        raise
    tracker.end()
    return result


def _finish(task, run_dir: Path, state: LoopState, tracker: Tracker) -> TrainResult:
    """Reload the best weights, score valid and test, write metrics + plots next to the model (``models.training.finish``,
    the distributed ranks' end too)."""
    best = load_bundle(run_dir / "model.pt").model
    head = {"best_epoch": float(state.best_epoch)}
    final = final_metrics(head, lambda split: task.evaluate(best, split), state.history, task.select)
    if task.also:  # the state chosen on the second metric, judged the same way, its keys prefixed ``also_``
        also = load_bundle(run_dir / ALSO_MODEL).model
        scored = [h for h in state.history if task.also in h]  # the first of equals is the one kept
        epoch = (max if task.higher_is_better else min)(scored, key=lambda h: h[task.also])["epoch"]
        judged = final_metrics({"best_epoch": float(epoch)}, lambda split: task.evaluate(also, split), [], "")
        final |= {f"also_{k}": v for k, v in judged.items()}
    plots = task.plots(best, state.history, run_dir)
    record(run_dir, final, state.history, tracker, step=state.epoch, best=state.best_epoch, plots=plots)
    return TrainResult(run_dir, final, state.history, state.best_epoch, tracker.run_id)
