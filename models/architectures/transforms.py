"""Feature transforms shared by training and serving: one definition each, so the two cannot drift apart.

Imported by the training set and its batch builder (``models.training.data``, ``models.training.batch_builder``), the models (``models.architectures.layers``, ``models.architectures.ranker``), the
attention reference and the server's input builder (``serving.inputs``). Each works on numpy arrays and torch
tensors alike and returns the same kind it was given.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

AGE_CENTER, AGE_SCALE = 40.0, 15.0  # years: the profile's age enters the ranker as (age - 40) / 15


def lengths(offsets):
    """Sequence lengths of a jagged batch from its (B + 1,) offsets."""
    return offsets[1:] - offsets[:-1]


def time_bucket(gap_seconds, num_buckets: int, out_int32: bool = False):
    """floor(log2(1 + |gap|)) clamped to [0, T - 1]: bucket k >= 1 holds the gaps in [2^k - 1, 2^(k+1) - 1).

    Counted by binary search against those exact integer edges (no log2 rounding at powers of two). The token
    of a history event (its gap to the previous event, or to the request) and the attention's time bias use it.
    """
    if not isinstance(gap_seconds, torch.Tensor):  # numpy's own search (through torch: ~5x slower on 64 gaps)
        gap = np.asarray(gap_seconds)
        gap = np.abs(gap.astype(np.float64 if gap.dtype.kind == "f" else np.int64))
        out = np.int32 if out_int32 else np.int64
        if num_buckets <= 1:
            return np.zeros(gap.shape, out)
        return np.searchsorted(_bucket_edges(num_buckets).astype(gap.dtype), gap, side="right").astype(out)
    if num_buckets <= 1:  # one bucket (or none: a model that reads no time, e.g. SASRec): every gap is 0
        return torch.zeros(gap_seconds.shape, dtype=torch.int32 if out_int32 else torch.int64)
    wide = torch.float64 if gap_seconds.is_floating_point() else torch.int64
    gap = gap_seconds.abs().to(wide)
    edges = torch.pow(2, torch.arange(1, num_buckets, device=gap.device, dtype=torch.int64)).sub_(1).to(wide)
    return torch.bucketize(gap, edges, right=True, out_int32=out_int32)


def fresh_cutoff(request_ts, delay_s: int):
    """The ranker reads a fresh event only if its time is before ``fresh_cutoff(request_ts, delay_s)``
    (seconds), in training and in serving alike.

    ``delay_s`` is the push path's latency budget (an event is visible online within it): reading only events
    older than that makes serving read what training read whatever the actual latency was. The request's own
    second is always left out: training cannot tell its events before the impression from those after it."""
    return np.floor(np.asarray(request_ts, np.float64)).astype(np.int64) - int(delay_s)


def previous_gaps(ts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each event's seconds since the event before it in its sequence (0 for a sequence's first event).

    The user model's time token: causal by construction, an event's feature reads only its own time and the
    one before it, so the state after event t is the same however far the sequence runs past t (a gap to the
    sequence's *last* event would tell every position how much of the window is still to come)."""
    ts = np.asarray(ts, np.int64)
    gap = np.zeros_like(ts)
    gap[1:] = ts[1:] - ts[:-1]
    starts = np.asarray(offsets[:-1], np.int64)
    gap[starts[starts < len(ts)]] = 0  # an empty sequence's start is its successor's start: 0 there too
    return gap


@functools.cache
def _bucket_edges(num_buckets: int) -> np.ndarray:
    """The integer edges 2^k - 1 (k = 1 .. T - 1) that ``time_bucket`` counts a gap against."""
    return 2 ** np.arange(1, num_buckets, dtype=np.int64) - 1


def normalize_age(age) -> np.ndarray:
    """Ages in years -> (N, 1) float32 ``(age - 40) / 15``; a missing (NaN) or infinite age counts as 0 years."""
    age = np.asarray(age, np.float64).reshape(-1)
    age = np.where(np.isfinite(age), age, 0.0)
    return ((age - AGE_CENTER) / AGE_SCALE).astype(np.float32)[:, None]
