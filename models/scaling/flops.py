"""Exact training FLOPs: one forward + backward on a real batch under ``FlopCounterMode``, per example.

``FlopCounterMode`` counts the matmul-class ops that actually run (mm, addmm, bmm, attention kernels,
including bucket padding inside the jagged attention); embedding lookups, norms and activations are not
FLOPs in its table. ``models.training.distributed.mfu`` registers the fused CPU attention kernel, which the table
lacks, so attention counts on CPU too.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

import models.training.distributed.mfu  # noqa: F401  (registers the CPU SDPA flop formula)
from models.training.prepare import Setup
from models.training.train import loss_fn


def step_flops(loss_of_step: Callable[[], torch.Tensor]) -> int:
    """FLOPs of ``loss_of_step()`` (the forward) plus its backward."""
    with FlopCounterMode(display=False) as counter:
        loss_of_step().backward()
    return int(counter.get_total_flops())


def sample_rows(rows: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """A fixed random sample of training rows (the history lengths of the FLOP batch must be typical)."""
    if len(rows) <= n:
        return rows
    return np.sort(np.random.default_rng(seed).choice(rows, n, replace=False))


def training_flops_per_example(setup: Setup, cfg, batch_size: int) -> float:
    """Forward + backward FLOPs of one training example of ``setup``'s untrained model (its weights are
    left untouched: no optimizer is attached, gradients are cleared)."""
    model = setup.bundle.model
    model.train()
    rows = sample_rows(setup.train_rows, batch_size, cfg.optim.seed)
    batch = setup.builder(rows)

    def loss():
        logits, aux = model(batch)
        return loss_fn(logits, batch.labels, aux, cfg)

    flops = step_flops(loss)
    model.zero_grad(set_to_none=True)
    return flops / len(rows)


def dense_parameters(model: torch.nn.Module) -> int:
    """Parameters outside the embedding tables (the usual 'model size' of scaling laws)."""
    return sum(p.numel() for n, p in model.named_parameters() if ".ec.embeddings." not in f".{n}")
