"""The leave-one-out view of a positive-only set: train pairs, evaluation histories, item attributes."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from models.sequential.data import ItemAttributes, SequenceSet
from models.training.data import USER_VOCAB_ROW, TrainingSet


def _items_per_user(data: TrainingSet) -> dict[int, list[int]]:
    # keyed by the model's user row (``SequenceSet.user_ids``: what the model embeds, features.vocabulary)
    ex = data.examples.sort_values([USER_VOCAB_ROW, "ts"])
    return {u: g["ad_id"].tolist() for u, g in ex.groupby(USER_VOCAB_ROW)}


def test_splits_and_pairs_match_a_per_user_reading(loo_set):
    ws, name = loo_set
    data = TrainingSet(ws.training(name))
    seqs = SequenceSet(data, max_len=4, time_buckets=8)
    by_user = _items_per_user(data)
    assert seqs.num_users == len(by_user)  # every user of the log has >= 3 items
    valid, test = seqs.targets("valid"), seqs.targets("test")
    for i, user in enumerate(seqs.user_ids):
        assert (valid[i], test[i]) == (by_user[user][-2], by_user[user][-1])
    users = np.arange(seqs.num_users)
    batch = seqs.train_batch(users)
    offsets = batch.history.offsets.numpy()
    hist = batch.history.ad_id.numpy()
    owner = np.searchsorted(offsets, batch.sources.numpy(), side="right") - 1
    for i, user in enumerate(seqs.user_ids):
        train = by_user[user][:-2]
        window = train[-4:]  # the last max_len train items
        assert hist[offsets[i] : offsets[i + 1]].tolist() == window
        expected = [(window[k], window[k + 1]) for k in range(len(window) - 1)]
        got = [
            (hist[s], t)
            for s, t in zip(batch.sources.numpy()[owner == i], batch.targets.numpy()[owner == i], strict=True)
        ]
        assert got == expected  # the state after each event predicts the next train item, nothing later
    history, user_id = seqs.eval_history(users[:5], "test")
    for i in range(5):  # the test history ends with the valid item
        assert history.ad_id[history.offsets[i + 1] - 1] == valid[i]
    assert torch.equal(user_id, torch.from_numpy(seqs.user_ids[:5]))


def test_item_attributes_are_every_attribute_of_every_ad(loo_set):
    ws, name = loo_set
    data = TrainingSet(ws.training(name))
    items = ItemAttributes.read(data.path, data.vocab["ad_id"])
    table = pd.read_parquet(data.path / "items.parquet").set_index("ad_id")
    for ad in range(data.vocab["ad_id"]):
        got = items.values[items.offsets[ad] : items.offsets[ad + 1]].tolist()
        assert got == (list(table.loc[ad, "categories"]) if ad in table.index else [])
    dense = items.mean_matrix().to_dense()
    row = dense[int(table.index[0])]
    assert torch.allclose(row.sum(), torch.tensor(1.0)) and (row > 0).sum() == len(
        table.iloc[0]["categories"]
    )
