"""``bench/sequential.py --profile``: where one training step's time goes, per model."""

from __future__ import annotations

import time

import numpy as np

from gemflow.workspace import Workspace


def step_profile(cfg, ws: Workspace, steps: int = 8) -> dict[str, float]:
    """Where one training step's time goes (ms, mean over ``steps`` steps after one warm-up): building the
    batch, the sequence encoder forward, the next-item head forward (queries, item vectors, softmax), backward,
    the optimizer step, and one host read-back of the loss (``host_sync``: what ``loss.item()`` costs a step;
    the training loop now reads its losses back once per ``optim.log_every`` steps, not every step)."""
    import torch

    from models.sequential.objective import next_item_loss
    from models.training.optimizers import make_optimizers
    from models.training.train import make_task

    task = make_task(cfg, ws)
    model = task.bundle.model.train()
    _, opt = make_optimizers(model, cfg.optim, sparse_in_backward=False)
    batches = task.epoch_batches(1)[: steps + 1]
    phases = {"batch": [], "encoder": [], "head": [], "backward": [], "optimizer": [], "host_sync": []}
    for i, users in enumerate(batches):
        t0 = time.perf_counter()
        batch = task.seqs.train_batch(users)
        t1 = time.perf_counter()
        states = model.sequence_states(batch.history, batch.user_id)
        t2 = time.perf_counter()
        nic = cfg.next_item
        loss = next_item_loss(
            _Cached(model, states),
            batch,
            task.loss_kind,
            nic.num_negatives,
            nic.shared_negatives,
            task.loss_dtype,
        )
        t3 = time.perf_counter()
        opt.zero_grad()
        loss.backward()
        t4 = time.perf_counter()
        opt.step()
        t5 = time.perf_counter()
        float(loss)
        t6 = time.perf_counter()
        if i:  # the first step warms caches and allocators
            for name, (a, b) in zip(
                phases, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6)), strict=True
            ):
                phases[name].append(1000 * (b - a))
    torch.set_grad_enabled(True)
    return {f"{name}_ms": float(np.mean(v)) for name, v in phases.items()}


class _Cached:
    """The model with its encoder output precomputed, so the head's forward is timed on its own."""

    def __init__(self, model, states):
        self.model, self.states = model, states
        self.num_items = model.num_items

    def sequence_states(self, history, user_id):
        return self.states

    def query(self, states):
        return self.model.query(states)

    def item_vectors(self, ids=None):
        return self.model.item_vectors(ids)
