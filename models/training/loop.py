"""The one training loop of ``gemflow train``, with or without ``--nproc`` (``models.training.train``,
``models.training.distributed.trainer``).

Epochs of steps, an evaluation of the valid split at every epoch's end (or every ``eval_every`` steps) and at the
end of the budget, the best state by the selection metric, early stopping after ``patience`` evaluations without
improvement, and the best state kept for export. How a step runs, how a split is scored, how a state is kept and
checkpointed is the ``Strategy``'s: a plain optimizer in one process, a DeepSpeed engine with sharded embeddings
across ranks. Every rank runs this loop; rank 0's evaluation is the one all of them act on (``Strategy.agree``),
so they improve, checkpoint and stop at the same step.

Resume: the loop starts at ``state.step`` (a checkpoint's), replaying nothing; epochs finished before are skipped
whole, a half-done epoch continues at its next step (its batches are a function of (seed, epoch)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm import tqdm


@dataclass
class LoopConfig:
    epochs: int
    patience: int  # evaluations without improvement before the run stops
    select: str  # the history key the best state is chosen by (e.g. "valid_ne")
    higher_is_better: bool
    eval_every: int = 0  # steps between evaluations; 0 = at the end of every epoch
    max_steps: int = 0  # 0 = every step of ``epochs`` epochs
    # steps between checkpoints (0: only at the end); None: after every evaluation. Either way one at the end,
    # or where patience ran out, and the strategy's own keeping of each new best state
    checkpoint_every: int | None = None
    # a second history key whose best state is kept too (``Strategy.keep_also``); early stopping never reads it.
    # Its best so far is read off the history, so a resume needs nothing more in the state
    also: str = ""


@dataclass
class LoopState:
    """Where a run is: what a checkpoint must hold for the loop to continue exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch of the last step done
    best: float | None = None  # the selection metric of the best evaluation so far
    best_step: int = 0
    best_epoch: int = 0
    bad_evals: int = 0  # evaluations since the best one (a resume with a larger patience continues)
    history: list[dict] = field(default_factory=list)  # one entry per evaluation (first: the untrained model)
    run_id: str | None = None  # the MLflow run a resume continues


class Strategy(Protocol):
    """What differs between one process and a group of ranks."""

    is_main: bool  # rank 0: shows progress

    def epoch_steps(self, epoch: int) -> list[Any]:
        """The batches of one epoch (1-based); the same on every rank, a function of (seed, epoch)."""

    def train_step(self, batch: Any, step: int, epoch: int) -> float | None:
        """One optimizer step (0-based ``step``); returns its loss, or a recent mean loss, or None when it read
        no loss back to the host this step (no per-step sync); a returned value is checked for NaN / inf."""

    def evaluate(self, state: LoopState) -> dict[str, float]:
        """The history entry of the model as it is now (the valid split's metrics among its keys)."""

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""

    def keep_best(self, state: LoopState) -> None:
        """Keep the current weights as the best state (what the run exports unless a later one beats it)."""

    def save_checkpoint(self, state: LoopState) -> None:
        """Persist everything a resume needs (the state included)."""

    def keep_also(self, state: LoopState) -> None:
        """Keep the current weights as the best state by ``LoopConfig.also`` (called only when it is set)."""


def improved(value: float, best: float | None, higher_is_better: bool) -> bool:
    if best is None:
        return True
    return value > best if higher_is_better else value < best


def _evaluate(strategy: Strategy, cfg: LoopConfig, state: LoopState) -> None:
    """Score the current weights; rank 0's verdict moves the best state and the patience count."""
    metrics = strategy.agree(strategy.evaluate(state))
    state.history.append(metrics)
    if improved(metrics[cfg.select], state.best, cfg.higher_is_better):
        state.best, state.best_step, state.best_epoch, state.bad_evals = (
            metrics[cfg.select], state.step, state.epoch, 0
        )  # fmt: skip
        strategy.keep_best(state)
    else:
        state.bad_evals += 1
    if cfg.also and best_so_far(state.history, cfg.also, cfg.higher_is_better):
        strategy.keep_also(state)


def best_so_far(history: list[dict], key: str, higher_is_better: bool) -> bool:
    """Whether the last evaluation beats every earlier one on ``key`` (evaluations without it do not count)."""
    *earlier, now = history
    return key in now and all(improved(now[key], h[key], higher_is_better) for h in earlier if key in h)


def patience_spent(cfg: LoopConfig, state: LoopState) -> bool:
    return state.bad_evals >= cfg.patience


def run_loop(strategy: Strategy, cfg: LoopConfig, state: LoopState) -> LoopState:
    """Train from ``state`` until the budget is spent or patience runs out; returns the final state."""
    if not state.history:  # the untrained model: the baseline every later evaluation must beat
        _evaluate(strategy, cfg, state)
    budget = cfg.max_steps or math.inf
    end = 0  # global index one past the current epoch's last step
    for epoch in range(1, cfg.epochs + 1):
        if patience_spent(cfg, state) or state.step >= budget:
            break
        steps = strategy.epoch_steps(epoch)
        start, end = end, end + len(steps)
        if end <= state.step:  # finished before a resume
            continue
        todo = range(state.step - start, len(steps))
        for i in tqdm(todo, desc=f"epoch {epoch}/{cfg.epochs}", disable=not strategy.is_main, leave=False):
            loss = strategy.train_step(steps[i], state.step, epoch)
            if loss is not None and not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {state.step} (lower optim.lr?)")
            state.step, state.epoch = state.step + 1, epoch
            epoch_end = i == len(steps) - 1
            last = state.step >= budget or (epoch_end and epoch == cfg.epochs)  # the end is always judged
            evaluated = last or (state.step % cfg.eval_every == 0 if cfg.eval_every else epoch_end)
            if evaluated:
                _evaluate(strategy, cfg, state)
            stop = patience_spent(cfg, state)
            every = cfg.checkpoint_every
            if evaluated if every is None else (last or stop or (every and state.step % every == 0)):
                strategy.save_checkpoint(state)
            if stop or last:
                break
    return state
