"""The end of a distributed run: the best checkpoint back in the engine, scored on the valid and test splits by
all ranks, and ``model.pt`` exported (``export_model``: the standard bundle of ``models.inference.bundle``, checked
against the engine); the files and the tracker's records are the one-process run's (``models.training.finish``)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from models.training.distributed.checkpoint import CheckpointStore
from models.training.distributed.engine import Parts
from models.training.distributed.evaluation import engine_logits, evaluate, predict
from models.training.distributed.moe import export_state_dict, moe_layers
from models.training.distributed.run_checkpoint import RunState, load_checkpoint
from models.training.finish import final_metrics, head_metrics, record, write_plots

log = logging.getLogger("gemflow.distributed")


EXPORT_CHECK_ROWS = 64  # validation examples the exported model is checked on against the engine


def export_model(p: Parts, run_dir: Path, state: RunState) -> float | None:
    """Write ``model.pt`` (rank 0): the standard bundle of ``models.inference.bundle``, loadable without DeepSpeed or
    torchrec. Full embedding tables gathered from their shards; MoE blocks as plain ``MixtureOfExperts`` with
    every rank's experts (``moe.export_state_dict``). Then the exported model is loaded back and scores a
    validation batch the engine also scores (eval mode): returns the largest |logit difference| (rank 0; None
    elsewhere or without validation rows). Collective: every rank calls it.
    """
    from models.inference.bundle import load_bundle, save_bundle

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


def finish(p: Parts, run_dir: Path, store: CheckpointStore, state: RunState, tracker) -> dict[str, float]:
    """The best state back in the engine, its validation + test metrics, the exported model, metrics.json and
    the plots (``models.training.finish``, the one-process run's end too); rank 0 writes and logs them."""
    best = store.path(state.best_step)
    if state.best_step != state.step and best.is_dir():  # not there: a run checkpointed before best tracking
        load_checkpoint(p, best)
        if p.rank == 0:
            log.info(
                "restored the best state (step %d, valid_ne %.4f) for export", state.best_step, state.best
            )
    head = {
        "steps": float(state.step),
        "best_step": float(state.best_step),
        "best_epoch": float(state.best_epoch),
    }
    valid = (
        predict(p, p.setup.valid_rows) if len(p.setup.valid_rows) else None
    )  # kept for the calibration plot
    scores = {
        "valid": lambda: head_metrics(*valid, "valid_") if valid is not None else {},
        "test": lambda: evaluate(p, p.setup.test_rows, "test_"),
    }
    final = final_metrics(head, lambda split: scores[split](), state.history, "valid_ne")
    diff = export_model(p, run_dir, state)
    if diff is not None:
        final["export_max_abs_logit_diff"] = diff
    if p.rank == 0:
        plots = write_plots(run_dir, state.history, valid, x="step")
        record(run_dir, final, state.history, tracker, step=state.step, best=state.best_step, plots=plots)
        if tracker is not None:
            tracker.end()
    dist.barrier()
    return final
