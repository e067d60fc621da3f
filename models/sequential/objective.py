"""The next-item loss: the state after an event scores the item that came next, against the catalog.

- ``full``: softmax cross-entropy over every item (affordable on CPU for catalogs of tens of thousands:
  positions x items x d multiply-adds per step; chunked, ``models.architectures.full_softmax``);
- ``sampled``: softmax over the positive and ``num_negatives`` items drawn uniformly, shared by the batch or
  drawn per position (uniform sampling needs no log-q correction; a sampled negative equal to the target is
  masked);
- ``bce``: SASRec's loss, binary cross-entropy of the positive and one uniform negative per position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.architectures.full_softmax import full_softmax_loss
from models.architectures.sampled_softmax import sampled_softmax_loss
from models.config import NEXT_ITEM_LOSSES, NextItemConfig
from models.sequential.data import TrainPairs
from models.training.distributed.precision import dtype_of, resolve


def resolve_loss_dtype(cfg: NextItemConfig) -> torch.dtype:
    """The full softmax's GEMM dtype for ``next_item.loss_precision``."""
    if cfg.loss_precision not in ("fp32", "bf16", "auto"):
        raise ValueError(f"next_item.loss_precision must be fp32, bf16 or auto, got {cfg.loss_precision!r}")
    return dtype_of(resolve(cfg.loss_precision, what="next_item.loss_precision")[0])


def resolve_loss(cfg: NextItemConfig, num_items: int) -> str:
    if cfg.loss not in NEXT_ITEM_LOSSES:
        raise ValueError(f"next_item.loss must be one of {NEXT_ITEM_LOSSES}, got {cfg.loss!r}")
    if cfg.loss != "auto":
        return cfg.loss
    return "full" if num_items <= cfg.full_softmax_max_items else "sampled"


def next_item_loss(
    model,
    batch: TrainPairs,
    loss: str,
    num_negatives: int,
    shared_negatives: bool = True,
    gemm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mean loss over the batch's (source, target) pairs; ``model`` has sequence_states/query/item_vectors.
    ``gemm_dtype``: the full softmax's GEMM dtype (``models.architectures.full_softmax``), None = fp32."""
    if batch.targets.numel() == 0:
        return model.query(model.sequence_states(batch.history, batch.user_id)).sum() * 0.0
    states = model.sequence_states(batch.history, batch.user_id)
    query = model.query(states[batch.sources])
    targets = batch.targets
    if loss == "full":
        return full_softmax_loss(query, model.item_vectors(), targets, gemm_dtype=gemm_dtype)
    catalog = model.num_items
    if loss == "sampled":
        shape = (num_negatives,) if shared_negatives else (len(targets), num_negatives)
        negatives = torch.randint(0, catalog, shape, device=query.device)
        # the query already carries the model's temperature (the user model's cosine / temperature)
        return sampled_softmax_loss(
            query, model.item_vectors(targets), model.item_vectors(negatives), targets, negatives
        )
    if loss == "bce":
        negatives = torch.randint(0, catalog, targets.shape, device=query.device)
        pos = (query * model.item_vectors(targets)).sum(-1)
        neg = (query * model.item_vectors(negatives)).sum(-1)
        return F.softplus(-pos).mean() + F.softplus(neg).mean()
    raise ValueError(f"unknown next-item loss {loss!r}")
