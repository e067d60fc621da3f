"""Feature transforms shared by training and serving: one definition each, so the two cannot drift apart.

Imported by the batch builder (``models.data``), the models (``models.layers``, ``models.ranker``), the
attention reference and the server's input builder (``serving.inputs``). Each works on numpy arrays and torch
tensors alike and returns the same kind it was given.
"""

from __future__ import annotations

import numpy as np
import torch

AGE_CENTER, AGE_SCALE = 40.0, 15.0  # years: the profile's age enters the ranker as (age - 40) / 15


def lengths(offsets):
    """Sequence lengths of a jagged batch from its (B + 1,) offsets."""
    return offsets[1:] - offsets[:-1]


def time_bucket(gap_seconds, num_buckets: int, out_int32: bool = False):
    """floor(log2(1 + |gap|)) clamped to [0, T - 1]: bucket k >= 1 holds the gaps in [2^k - 1, 2^(k+1) - 1).

    Counted by binary search against those exact integer edges (no log2 rounding at powers of two). The token
    of a history event (its gap to the last event or to the request) and the attention's time bias both use it.
    """
    if not isinstance(gap_seconds, torch.Tensor):
        return time_bucket(torch.from_numpy(np.asarray(gap_seconds)), num_buckets, out_int32).numpy()
    if num_buckets <= 1:  # one bucket (or none: a model that reads no time, e.g. SASRec): every gap is 0
        return torch.zeros(gap_seconds.shape, dtype=torch.int32 if out_int32 else torch.int64)
    wide = torch.float64 if gap_seconds.is_floating_point() else torch.int64
    gap = gap_seconds.abs().to(wide)
    edges = torch.pow(2, torch.arange(1, num_buckets, device=gap.device, dtype=torch.int64)).sub_(1).to(wide)
    return torch.bucketize(gap, edges, right=True, out_int32=out_int32)


def normalize_age(age) -> np.ndarray:
    """Ages in years -> (N, 1) float32 ``(age - 40) / 15``; a missing (NaN) or infinite age counts as 0 years."""
    age = np.asarray(age, np.float64).reshape(-1)
    age = np.where(np.isfinite(age), age, 0.0)
    return ((age - AGE_CENTER) / AGE_SCALE).astype(np.float32)[:, None]
