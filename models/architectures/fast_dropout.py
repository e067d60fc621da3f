"""Dropout whose random numbers cost an eighth of ``nn.Dropout``'s on CPU.

``nn.Dropout`` draws one Bernoulli sample per element (``bernoulli_``, a quarter of a SASRec training step on
one CPU thread). Here one random 64-bit word gives eight elements a random byte each, and an element is kept
when its byte is >= round(p * 256): the drop probability is ``p`` rounded to 1/256 (0.5 and 0.25 exactly, 0.2
as 0.199), and kept elements are scaled by 1 / (1 - that probability) so the expectation is unchanged. It has
no parameters: a model's state dict is the same with either.
"""

from __future__ import annotations

import torch
from torch import nn


def fast_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    if not training or p <= 0:
        return x
    if p >= 1:
        return torch.zeros_like(x)
    threshold = round(p * 256)
    n = x.numel()
    words = torch.randint(-(2**63), 2**63 - 1, ((n + 7) // 8,), dtype=torch.int64, device=x.device)
    keep = words.view(torch.uint8)[:n].view(x.shape) >= threshold
    return x * keep * (256 / (256 - threshold))


class FastDropout(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
