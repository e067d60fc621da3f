"""The shared train/serve transforms: exact time buckets, the age normalisation, jagged lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.architectures.transforms import (
    AGE_CENTER,
    AGE_SCALE,
    lengths,
    normalize_age,
    previous_gaps,
    time_bucket,
)


def _log2_bucket(gap: int, num_buckets: int) -> int:
    """floor(log2(1 + |gap|)) in exact integer arithmetic, clamped to the table."""
    return min((1 + abs(gap)).bit_length() - 1, num_buckets - 1)


@pytest.mark.parametrize("num_buckets", [1, 5, 32])
def test_time_bucket_is_floor_log2_exactly_on_numpy_and_torch(num_buckets):
    edges = [2**k - 1 for k in range(40)]
    gaps = np.array(sorted({g + d for g in edges for d in (-1, 0, 1)} | {-7, -8, 86_400, 2**33}), np.int64)
    want = np.array([_log2_bucket(int(g), num_buckets) for g in gaps])
    got_np = time_bucket(gaps, num_buckets)
    got_t = time_bucket(torch.from_numpy(gaps), num_buckets)
    assert isinstance(got_np, np.ndarray) and got_np.dtype == np.int64
    assert np.array_equal(got_np, want) and torch.equal(got_t, torch.from_numpy(want))
    floats = np.array([0.5, 0.99, 1.0, 2.5, 3.0], np.float64)  # fractional gaps: [2^k - 1, 2^(k+1) - 1)
    assert time_bucket(floats, 32).tolist() == [0, 0, 1, 1, 2]
    assert time_bucket(torch.from_numpy(gaps), num_buckets, out_int32=True).dtype == torch.int32


@pytest.mark.parametrize("out_int32", [False, True])
def test_time_bucket_numpy_path_equals_torch_on_random_gaps(out_int32):
    """The numpy path searches its own edges (no torch round trip): the same buckets as torch's bucketize."""
    rng = np.random.default_rng(0)
    ints = rng.integers(-(10**10), 10**10, 100_000) >> rng.integers(0, 34, 100_000)  # every magnitude
    for gaps in (ints, ints / 3.0):
        for num_buckets in (2, 24, 40):
            got = time_bucket(gaps, num_buckets, out_int32)
            want = time_bucket(torch.from_numpy(gaps), num_buckets, out_int32).numpy()
            assert got.dtype == want.dtype and np.array_equal(got, want)


def test_age_is_centred_and_scaled_and_missing_counts_as_zero_years():
    got = normalize_age(np.array([40.0, 55.0, np.nan, np.inf, 18.0]))
    assert got.dtype == np.float32 and got.shape == (5, 1)
    want = np.float32([0.0, 1.0, -AGE_CENTER / AGE_SCALE, -AGE_CENTER / AGE_SCALE, (18 - 40) / 15])
    assert np.array_equal(got[:, 0], want)
    assert np.array_equal(normalize_age(55.0), np.float32([[1.0]]))  # one request's scalar


def test_lengths_of_numpy_and_torch_offsets():
    assert lengths(np.array([0, 3, 3, 7])).tolist() == [3, 0, 4]
    assert torch.equal(lengths(torch.tensor([0, 3, 3, 7])), torch.tensor([3, 0, 4]))


def test_previous_gaps_reset_at_every_sequence_start():
    ts = np.array([10, 13, 20, 5, 7, 100], np.int64)
    offsets = np.array([0, 3, 3, 5, 6, 6])  # lengths 3, 0, 2, 1, 0
    assert previous_gaps(ts, offsets).tolist() == [0, 3, 7, 0, 2, 0]
    assert previous_gaps(np.zeros(0, np.int64), np.array([0, 0])).tolist() == []
