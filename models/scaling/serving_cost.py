"""What one ranking request costs the online ranker: ``user_side`` once + ``score`` for N candidates."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

import models.training.distributed.mfu  # noqa: F401  (registers the CPU SDPA flop formula)
from models.training.batch_builder import BatchBuilder


@torch.no_grad()
def serving_cost(model, builder: BatchBuilder, rows: np.ndarray, candidates: int, repeats: int) -> dict:
    """Median milliseconds and FLOPs of one request: the user of ``rows[0]`` against ``candidates`` ads drawn
    from ``rows`` (repeated when there are fewer), both scaled to 1,000 candidates."""
    if len(rows) == 0:
        raise ValueError("serving cost needs at least one example row")
    model.eval()
    request = builder(rows[:1])
    pick = np.random.default_rng(0).choice(rows, candidates, replace=len(rows) < candidates)
    cands = builder.data.candidates(pick, builder.dense)
    cands = replace(cands, offsets=torch.tensor([0, candidates]))

    def one_request():
        side = model.user_side(request.history, request.profile, request.user_tokens, request.user_token_mask)
        return model.score(side, cands)

    for _ in range(2):  # warm-up: first calls allocate and pick kernels
        one_request()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_request()
        times.append(time.perf_counter() - start)
    with FlopCounterMode(display=False) as counter:
        one_request()
    scale = 1000.0 / candidates
    return {
        "serving_ms_per_1000": float(np.median(times)) * 1e3 * scale,
        "serving_flops_per_1000": float(counter.get_total_flops()) * scale,
        "serving_candidates": candidates,
    }
