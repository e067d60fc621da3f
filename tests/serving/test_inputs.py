"""Train/serve parity: the same raw features through training's batch builder (``models.training.batch_builder.BatchBuilder``)
and the server's input builder (``serving.inputs``) give identical tensors."""

from __future__ import annotations

import copy
from dataclasses import fields

import numpy as np
import pytest
import torch

from models.training.batch_builder import BatchBuilder
from models.training.data import profile_column
from serving import inputs
from serving.ad_table import AdSnapshot
from serving.user_features import UserFeatures
from tests.models.fixtures import tiny_dense, tiny_set

RECENT = 16  # ranker.recent_events
BUCKETS = 32
# online-store list columns (serving.user_features) -> history fields of the training set
ONLINE = {
    "recent_ad_ids": "ad_id",
    "recent_actions": "action",
    "recent_category_ids": "category_id",
    "recent_ts": "ts",
    "recent_surfaces": "surface",
    "recent_advertiser_ids": "advertiser_id",
}


def _raw(data, row: int):
    """What the online store and the ad table hold for example ``row``: the user's events before it (all of
    them: the server cuts to the recent window itself), the profile, and the candidate ad's features."""
    ex, frame = data.examples.iloc[row], data.dense_frame().iloc[[row]]
    start = data.seq_offsets[ex["user_row"]]
    recent = {name: data.seq_values[f][start : start + ex["cut"]].copy() for name, f in ONLINE.items()}
    feats = UserFeatures(
        age=float(profile_column(frame, "age")[0]),
        gender=int(profile_column(frame, "gender")[0]),
        country=int(profile_column(frame, "country")[0]),
        recent=recent,
        embedding=None,
        embedding_version=None,
    )
    spec = tiny_dense()
    values = {c: frame[c].to_numpy() for c in spec.columns}
    values |= {"ad_advertiser_id": [ex["advertiser_id"]], "ad_category_id": [ex["category_id"]]}
    ads = inputs.AdArrays.build(AdSnapshot.from_rows([ex["ad_id"]], values, None), spec)
    return ex, feats, ads


def _assert_same(trained, served) -> None:
    for f in fields(trained):
        a, b = getattr(trained, f.name), getattr(served, f.name)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{type(trained).__name__}.{f.name}: {a} != {b}"


@pytest.mark.parametrize("delay_s", [None, 0, 1, 600])
def test_serving_inputs_equal_training_batches_exactly(delay_s):
    """The transforms on equal raw values (the store's list here holds every event before the impression); that
    the store a pipeline wrote holds those values is ``test_fresh_parity.py``'s."""
    data = tiny_set()
    builder = BatchBuilder(data, tiny_dense(), history_len=RECENT, time_buckets=BUCKETS, gap_to="request",
                           fresh_delay_s=delay_s)  # fmt: skip
    cuts = data.examples["cut"].to_numpy()
    rows = [int(np.argmin(cuts)), int(np.argmax(cuts)), *range(0, len(cuts), max(1, len(cuts) // 12))]
    assert cuts[rows].min() < RECENT < cuts[rows].max()  # short histories and ones the window cuts
    for row in rows:
        batch = builder(np.array([row]))
        ex, feats, ads = _raw(data, row)
        events, filled = inputs.recent_events(feats, ads, float(ex["ts"]) + 0.25, RECENT, BUCKETS, delay_s)
        cands, unknown = inputs.candidates(np.array([ex["ad_id"]]), int(ex["surface"]), ads)
        assert not filled and unknown == 0
        _assert_same(batch.history, events)
        _assert_same(batch.candidates, cands)
        _assert_same(batch.profile, inputs.profile(int(ex["user_id"]), feats))


@pytest.mark.parametrize("age", [None, float("nan")])
def test_a_missing_age_is_served_as_training_reads_it(age):
    data = copy.copy(tiny_set())  # the same set, its profile ages unknown (the point-in-time join found none)
    data.ranker = data.ranker.assign(user_age=np.nan)
    trained = BatchBuilder(data, tiny_dense(), history_len=RECENT, time_buckets=BUCKETS, gap_to="request")
    feats = UserFeatures(age=age, gender=1, country=2, recent=None, embedding=None, embedding_version=None)
    served = inputs.profile(7, feats).dense
    assert served.dtype == torch.float32 and torch.equal(served, trained(np.array([0])).profile.dense)
