"""GEMMs that see a few row counts, not a new one every step or request: oneDNN compiles a kernel per shape.

PyTorch runs a bf16 ``nn.Linear`` on CPU through oneDNN (and serving's fused linears, ``models.inference.onednn``, in fp32),
which builds a primitive for every GEMM shape: it JIT-compiles a kernel for it (AMX / AVX-512 brgemm code) and
keeps it in a cache of 1,024 entries. The distributed tower's token count changes every step (users are packed to
a token budget), so every step met new shapes: its forward and backward GEMMs were compiled again (an AMX Xeon, 1
thread, a (7,000 x 256) x (256 x 1,024) linear forward + backward: 27 ms with a repeated row count, 50 ms with a
new one each call), and the new primitives' code and scratch memory grew the heap (~25 MiB a step) whose fresh
pages then had to be faulted in (the kernel's page clearing was the top symbol of a rank's profile). Serving
requests' candidate counts vary the same way (``models.inference.one_user.score_padded``).

``bucket_rows(m)``: 32 sizes per power of two, at most ~3% extra rows. ``RowBucketedLinear`` pads its input's rows
with zeros up to it, runs the GEMM on that, and returns the first ``m`` rows. The padded rows give zero gradients
to the weight and bias (their output gradient is zero), so values and gradients are those of ``nn.Linear``;
autograd pads the output gradient the same way, so the backward GEMMs reuse cached primitives too.
``bucket_linear_rows`` swaps a model's plain ``nn.Linear`` modules for it in place (same parameters, same
state-dict keys); FP8 or other subclasses are left alone. The distributed trainer does so for a bf16 tower on CPU
(fp32 GEMMs run in MKL, which compiles nothing per shape; a compiled tower has inductor's own GEMMs).
``bench/row_buckets.py`` measures both ways side by side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PER_OCTAVE = 32  # bucket sizes per power of two: padding <= 1/32 of the rows
EXACT_BELOW = 256  # small GEMMs keep their row count (few distinct ones, and padding them is relatively dear)


def bucket_rows(m: int) -> int:
    """The smallest bucket size >= ``m``: a multiple of 2^(floor(log2 m)) / ``PER_OCTAVE``."""
    if m < EXACT_BELOW:
        return m
    step = 1 << (m.bit_length() - PER_OCTAVE.bit_length())  # 2^(floor(log2 m) - log2 PER_OCTAVE)
    return -(-m // step) * step


class RowBucketedLinear(nn.Linear):
    """``nn.Linear`` computed on rows padded to ``bucket_rows`` (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        padded = bucket_rows(rows)
        if padded == rows:
            return F.linear(x, self.weight, self.bias)
        flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))
        return F.linear(flat, self.weight, self.bias)[:rows].view(*x.shape[:-1], self.out_features)


def bucket_linear_rows(model: nn.Module) -> int:
    """Turns every plain ``nn.Linear`` of ``model`` into a ``RowBucketedLinear`` in place; how many."""
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowBucketedLinear
            swapped += 1
    return swapped
