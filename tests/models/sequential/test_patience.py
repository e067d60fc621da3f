"""bench/sequential_patience.py replays the training loop's early stopping on a finished run's history."""

from __future__ import annotations

import pytest

from bench.sequential_patience import replay


def _history(values):
    return [{"valid_x": v, "train_seconds": 9.0, "eval_seconds": 1.0} for v in values]


def test_replay_stops_where_the_loop_would_and_keeps_its_best_state():
    # evaluations 0..7: a best at 2, a tie at 3 (no improvement), a new best at 6
    history = _history([0.1, 0.2, 0.5, 0.5, 0.4, 0.3, 0.6, 0.55])
    early = replay(history, "valid_x", 3)
    assert (early["stop"], early["kept"]) == (5, 2)  # 3, 4, 5 without improvement
    assert early["valid_lost"] == pytest.approx(0.1)  # 0.6 - 0.5: the later best it never saw
    assert early["time_share"] == pytest.approx(6 / 8)
    late = replay(history, "valid_x", 4)
    assert (late["stop"], late["kept"], late["valid_lost"]) == (7, 6, 0.0)
    assert late["time_share"] == pytest.approx(1.0)
