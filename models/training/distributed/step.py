"""One training step of a rank: its token-budget share of the global batch -> ids -> embeddings -> the engine's
dense tower -> loss (weighted by the rank's share of the examples, + MoE load-balancing loss); then what the
step did (``step_stats``) and the mean of the last steps over ranks, logged (``log_steps``)."""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist

from models.training.distributed.batching import Step
from models.training.distributed.engine import Parts
from models.training.distributed.mfu import mfu, user_model_flops
from models.training.distributed.model import cast_batch, sparse_ids, to_engine
from models.training.distributed.moe import moe_aux_loss

log = logging.getLogger("gemflow.distributed")


def step_seed(seed: int, step: int, world: int, rank: int) -> int:
    return (seed * 1_000_003 + step * world + rank) % (2**63 - 1)


def forward_loss(p: Parts, rows: np.ndarray, global_examples: int):
    """(loss, parts of the loss) of this rank's share of one step.

    Token-balanced shares hold different example counts, and DeepSpeed averages the ranks' gradients; weighting
    this rank's mean loss by its share of the examples (x world) makes that average the global batch's mean,
    so N ranks take the step one rank would take on the whole batch.
    """
    from models.training.train import loss_fn

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


def step_stats(p: Parts, step: Step, loss: float, parts: dict, elapsed: float, num_dense: int) -> dict:
    """What one step did, for every rank (the plan is known everywhere; the loss is this rank's)."""
    cfg = p.cfg
    max_len = cfg.user_model.max_history
    cuts = p.setup.data.examples["cut"].to_numpy()
    lens = np.minimum(cuts[np.concatenate(step.rows)], max_len)
    flops = user_model_flops(cfg.user_model, lens, num_dense=num_dense, moe_top_k=cfg.distributed.moe.top_k)
    return {"loss": loss, **parts, "seconds": elapsed, "flops": flops, "tokens": list(step.tokens),
            "imbalance": step.imbalance, "examples": sum(len(r) for r in step.rows)}  # fmt: skip


def log_steps(p: Parts, tracker, recent: list[dict], step: int) -> None:
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
