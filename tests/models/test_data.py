"""Daily user-history snapshots: the cut never passes the example's day start, one history per user-day."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.training.batch_builder import BatchBuilder
from models.training.data import DAY_S
from tests.models.fixtures import tiny_dense, tiny_set


def _builder(**kw) -> BatchBuilder:
    return BatchBuilder(tiny_set(), tiny_dense(), history_len=32, time_buckets=32, gap_to="previous", **kw)


def test_snapshot_cut_is_the_users_history_before_the_examples_day():
    data = tiny_set()
    rows = np.arange(len(data.examples))
    cuts = data.snapshot_cuts(rows)
    ex = data.examples
    ts = data.seq_values["ts"]
    assert (cuts <= ex["cut"].to_numpy()).all() and (cuts >= 0).all()
    for row, snap in zip(rows, cuts, strict=True):
        base = data.seq_offsets[ex["user_row"][row]]
        day_start = ex["ts"][row] - ex["ts"][row] % DAY_S
        assert (ts[base : base + snap] < day_start).all()  # nothing of the example's day leaks in
        if snap < ex["cut"][row]:
            assert ts[base + snap] >= day_start  # and nothing before it is left out
    assert (cuts < ex["cut"].to_numpy()).any()  # the fixture has same-day events before impressions


def test_a_snapshot_batch_encodes_each_user_day_once_in_row_order():
    data, builder = tiny_set(), _builder(snapshot="day")
    rows = builder.grouped(np.arange(len(data.examples)))
    group, cuts = data.snapshot_groups(rows)
    batch = builder(rows)
    assert batch.history.batch_size == len(np.unique(group))
    torch.testing.assert_close(batch.labels, data.labels(rows))  # candidates keep the rows' order
    assert torch.equal(batch.candidates.ad_id, torch.as_tensor(data.examples["ad_id"].to_numpy()[rows]))
    sizes = batch.candidates.offsets.diff().numpy()
    assert sizes.sum() == len(rows) and (sizes > 0).all()
    expected = np.minimum(cuts, 32)[np.r_[0, np.flatnonzero(np.diff(group)) + 1]]
    assert np.array_equal(batch.history.lengths.numpy(), expected)


def test_unsorted_rows_still_get_their_own_snapshot():
    data, builder = tiny_set(), _builder(snapshot="day")
    rows = np.random.default_rng(0).permutation(len(data.examples))[:50]
    batch = builder(rows)
    # each run of one user-day is one history; its events are exactly that snapshot's last 32 events
    starts = batch.candidates.offsets[:-1].numpy()
    _, cuts = data.snapshot_groups(rows)
    assert np.array_equal(batch.history.lengths.numpy(), np.minimum(cuts[starts], 32))
    torch.testing.assert_close(batch.labels, data.labels(rows))


def test_epoch_order_is_a_permutation_that_keeps_user_days_together():
    data, builder = tiny_set(), _builder(snapshot="day")
    rows = data.split_rows("train")
    order = builder.epoch_order(rows, np.random.default_rng(1))
    assert sorted(order) == sorted(rows)
    group, _ = data.snapshot_groups(order)
    runs = 1 + np.count_nonzero(np.diff(group))
    assert runs == len(np.unique(group))  # each group is one contiguous run
    plain = _builder().epoch_order(rows, np.random.default_rng(1))
    assert np.array_equal(plain, np.random.default_rng(1).permutation(rows))  # unchanged without snapshots


def test_bad_snapshot_settings_are_named():
    with pytest.raises(ValueError, match="snapshot must be one of"):
        _builder(snapshot="hour")
    emb = np.zeros((len(tiny_set().examples), 8), np.float32)
    with pytest.raises(ValueError, match="snapshot batches are for the user model"):
        _builder(snapshot="day", user_embeddings=emb, num_user_tokens=2)


def test_a_dense_feature_constant_on_the_train_split_is_left_out():
    """Yesterday's ad stats are all missing on the first logged day: a feature the train split never varies
    gets no weight it could learn, so it is dropped and a later value cannot move the scores."""
    import pandas as pd

    from models.training.dense import DenseSpec

    train = pd.DataFrame({"ctr_1d": [np.nan] * 4, "quality": [0.1, 0.5, 0.2, 0.9], "one": [1.0] * 4})
    spec = DenseSpec.fit(train, ["ctr_1d", "quality", "one"])
    assert spec.columns == ["quality"]
    later = pd.DataFrame({"ctr_1d": [0.3], "quality": [0.5], "one": [7.0]})
    x = spec.apply(later)
    assert x.shape == (1, 1)
    expected = (np.log1p(0.5) - np.log1p(train["quality"]).mean()) / np.log1p(train["quality"]).std(ddof=0)
    np.testing.assert_allclose(x[0, 0], expected, rtol=1e-5)


@pytest.mark.parametrize("delay_s", [0, 1, 120, 3600])
def test_fresh_delay_reads_only_events_older_than_the_cutoff(delay_s):
    """The ranker's window at an example: the newest events before it that are older than ``fresh_cutoff``."""
    data = tiny_set()
    rows = np.arange(len(data.examples))
    ex, ts = data.examples, data.seq_values["ts"]
    whole = data.history(rows, 10**6, 32, gap_to="request")
    fresh = data.history(rows, 10**6, 32, gap_to="request", fresh_delay_s=delay_s)
    cutoff = ex["ts"].to_numpy() - delay_s
    for i, row in enumerate(rows):
        base = data.seq_offsets[ex["user_row"][row]]
        before = ts[base : base + ex["cut"][row]]
        got = fresh.ts[fresh.offsets[i] : fresh.offsets[i + 1]].numpy()
        assert np.array_equal(got, before[before < cutoff[i]])
    if delay_s >= 120:  # events 10-600 s apart in the fixture: these delays leave some out
        assert fresh.offsets[-1] < whole.offsets[-1]
