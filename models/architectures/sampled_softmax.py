"""The next-item sampled softmax, the one implementation every next-item loss uses (the user model's
auxiliary next-event loss, its sharded twin in ``models.training.distributed``, and the next-item objective's
``sampled`` loss).

Each query scores its target against uniformly drawn negatives (so no log-q correction), either shared by the
batch or its own; a sampled negative equal to the row's target is no negative (masked). Logits are
``q . v / temperature``: the callers that score cosines pass the configured ``next_item_temperature``; a query
already divided by it passes 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sampled_softmax_loss(
    query: torch.Tensor,
    target_vectors: torch.Tensor,
    negative_vectors: torch.Tensor,
    target_ids: torch.Tensor,
    negative_ids: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean cross-entropy of (N, d) ``query`` rows: target (N, d) at index 0 against the negatives, (M, d) with
    (M,) ids shared by every row, or (N, M, d) with (N, M) ids, each row its own."""
    if temperature <= 0:
        raise ValueError(f"the sampled softmax temperature must be > 0, got {temperature}")
    pos = (query * target_vectors).sum(-1, keepdim=True)
    if negative_vectors.dim() == 3:
        neg = torch.bmm(negative_vectors, query.unsqueeze(-1)).squeeze(-1)
    else:
        neg = query @ negative_vectors.T
    neg = neg.masked_fill(negative_ids.expand(len(query), -1) == target_ids[:, None], float("-inf"))
    logits = torch.cat([pos, neg], 1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(query), dtype=torch.long, device=query.device))
