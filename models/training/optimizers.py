"""The optimizers of a one-process run: embedding tables updated inside backward by torchrec's fused row-wise
Adagrad, AdamW over the rest, the dense learning-rate schedule (linear warm-up, then cosine or linear decay), and
the in-backward optimizers' state for checkpoints."""

from __future__ import annotations

import math

import torch
from torch import nn


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(embedding tables of the torchrec EmbeddingCollection, every other parameter)."""
    sparse = [p for n, p in model.named_parameters() if ".ec.embeddings." in f".{n}"]
    ids = {id(p) for p in sparse}
    return sparse, [p for p in model.parameters() if id(p) not in ids]


def make_optimizers(
    model: nn.Module, cfg, *, sparse_in_backward: bool = True
) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    """(tables updated in backward by row-wise Adagrad, AdamW over the rest); with ``sparse_in_backward``
    False every parameter, the tables included, is AdamW's."""
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    sparse, dense = split_parameters(model) if sparse_in_backward else ([], list(model.parameters()))
    if sparse:
        apply_optimizer_in_backward(RowWiseAdagrad, sparse, {"lr": cfg.sparse_lr})
    return sparse, torch.optim.AdamW(
        dense, lr=cfg.lr, betas=(0.9, cfg.adam_beta2), weight_decay=cfg.weight_decay
    )


def scheduled_lr(base_lr: float, step: int, total_steps: int, oc) -> float:
    """The dense lr for optimizer step ``step`` (0-based) of ``total_steps``: linear warm-up, then decay.

    Stateless (a function of the step counter the checkpoint keeps), so a resumed run continues the schedule.
    """
    if oc.warmup_steps and step < oc.warmup_steps:
        return base_lr * (step + 1) / oc.warmup_steps
    if oc.lr_decay == "none":
        return base_lr
    span = max(1, total_steps - oc.warmup_steps)
    progress = min(1.0, (step - oc.warmup_steps) / span)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if oc.lr_decay == "cosine" else 1 - progress
    return base_lr * (oc.min_lr_ratio + (1 - oc.min_lr_ratio) * shape)


def sparse_optimizer_state(sparse: list[nn.Parameter]) -> list[dict]:
    return [p._in_backward_optimizers[0].state_dict() for p in sparse]


def load_sparse_optimizer_state(sparse: list[nn.Parameter], states: list[dict]) -> None:
    for p, state in zip(sparse, states, strict=True):
        p._in_backward_optimizers[0].load_state_dict(state)
