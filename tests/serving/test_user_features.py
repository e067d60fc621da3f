"""The adaptive feature-read budget: 1.5 x the p99.9 of recent reads, between the configured floor and cap."""

from __future__ import annotations

import numpy as np
import pytest

from serving.user_features import MIN_SAMPLES, adaptive_budget


def test_budget_follows_the_measured_tail_within_floor_and_cap():
    rng = np.random.default_rng(0)
    fast = list(rng.uniform(0.0005, 0.002, 2000))  # a quiet SQLite store: 0.5-2 ms
    assert adaptive_budget(fast, 0.008, 0.030) == 0.008  # the floor: the tail is well inside it
    busy = list(rng.uniform(0.002, 0.014, 2000))  # a busy machine: up to 14 ms
    assert adaptive_budget(busy, 0.008, 0.030) == pytest.approx(1.5 * np.percentile(busy, 99.9))
    hung = [0.5] * 2000  # a store that stopped answering: a request still costs at most the cap
    assert adaptive_budget(hung, 0.008, 0.030) == 0.030


def test_budget_stays_at_the_floor_until_enough_reads():
    assert adaptive_budget([0.1] * (MIN_SAMPLES - 1), 0.008, 0.030) == 0.008
