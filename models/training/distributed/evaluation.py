"""Evaluation by all ranks together: each scores an equal share of the rows, then all-gather; the metrics are
the one-process run's (``models.training.finish.head_metrics``). Collective: every rank calls it with the same rows."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
import torch.distributed as dist

from models.training.distributed.engine import Parts
from models.training.distributed.model import cast_batch, sparse_ids, to_engine
from models.training.finish import head_metrics

log = logging.getLogger("gemflow.distributed")


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
    return head_metrics(*predict(p, rows), prefix)


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
