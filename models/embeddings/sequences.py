"""Users' event sequences as the user model reads them, and the one computation of their retrieval queries.

``UserSequences`` holds each user's most recent events flat (values + offsets): the embedding refresh builds
them from the offline histories, the ranker server from the online recent-event list a request read
(``serving.retrieval.query``). ``query_vectors`` turns either into next-item queries through the same steps
(time gaps to the previous event, raw ids -> the model's rows, ``ad_vectors.user_queries``), so a query
computed at request time equals the refresh's for the same events.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from features.histories import Histories
from features.schema import HISTORY_FIELDS
from models.architectures.transforms import lengths, previous_gaps, time_bucket
from models.embeddings.ad_vectors import user_queries
from models.embeddings.batching import token_budget_batches
from models.inference.bundle import ModelBundle
from models.training.batch import Events


@dataclass
class UserSequences:
    """Each user's most recent events, flat (values + offsets), the unit the refresh encodes."""

    user_ids: np.ndarray  # (U,) int64
    offsets: np.ndarray  # (U + 1,) int64
    values: dict[str, np.ndarray]  # HISTORY_FIELDS -> (offsets[-1],) int64, ts in seconds

    @property
    def lengths(self) -> np.ndarray:
        return lengths(self.offsets)

    def take(self, rows: np.ndarray, last: int | None = None) -> UserSequences:
        """The users ``rows`` (in that order), each cut to its ``last`` most recent events."""
        rows = np.asarray(rows, np.int64)
        end = self.offsets[rows + 1]
        start = self.offsets[rows] if last is None else np.maximum(self.offsets[rows], end - last)
        lens = end - start
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        idx = np.repeat(start - offsets[:-1], lens) + np.arange(offsets[-1])
        return UserSequences(self.user_ids[rows], offsets, {f: v[idx] for f, v in self.values.items()})

    def events(self, num_buckets: int) -> Events:
        """The user model's input: each event's gap to the one before it (``gap_to="previous"``, as trained)."""
        gap = time_bucket(previous_gaps(self.values["ts"], self.offsets), num_buckets)
        t = {f: torch.from_numpy(np.ascontiguousarray(self.values[f])) for f in HISTORY_FIELDS}
        return Events(**t, gap_bucket=torch.from_numpy(gap), offsets=torch.from_numpy(self.offsets))

    @classmethod
    def from_histories(cls, h: Histories) -> UserSequences:
        return cls(h.user_ids, h.offsets, h.values)


def model_inputs(bundle: ModelBundle, history: Events, user_ids: np.ndarray) -> tuple[Events, torch.Tensor]:
    """Raw ad / user ids -> the rows of the model's tables, by its vocabularies (as training mapped them)."""
    ad, user = bundle.vocabularies.get("ad_id"), bundle.vocabularies.get("user_id")
    if ad is not None:
        history = replace(history, ad_id=torch.from_numpy(ad.map(history.ad_id.numpy())))
    return history, torch.from_numpy(user.map(user_ids) if user is not None else user_ids)


def query_vectors(
    bundle: ModelBundle,
    seqs: UserSequences,
    token_budget: int = 32768,
    max_users: int = 512,
    one_user: torch.jit.ScriptModule | None = None,
) -> np.ndarray:
    """(U, d) float32 next-item queries of ``seqs`` (in its order), batch by batch within the token budget: the
    refresh's cached queries and the server's fresh ones both come from here. ``one_user``: the model's
    ``models.inference.one_user_query`` module, used for a single user with events (a request's fresh query)."""
    if one_user is not None and len(seqs.user_ids) == 1 and seqs.offsets[-1] > 0:
        return _one_user_query(bundle, seqs, one_user)[None]
    out = np.zeros((len(seqs.user_ids), bundle.cfg.d_model), np.float32)
    for rows in token_budget_batches(seqs.lengths, token_budget, max_users):
        batch = seqs.take(rows)
        history, user_id = model_inputs(bundle, batch.events(bundle.cfg.time_buckets), batch.user_ids)
        out[rows] = user_queries(bundle, history, user_id)
    return out


@torch.inference_mode()
def _one_user_query(bundle: ModelBundle, seqs: UserSequences, one_user: torch.jit.ScriptModule) -> np.ndarray:
    """The same inputs as the batched path (gaps, mapped ids), the attention's time buckets, one scripted call."""
    from models.inference.one_user_query import FIELDS

    buckets = bundle.cfg.time_buckets
    history, _ = model_inputs(bundle, seqs.events(buckets), seqs.user_ids)
    ts = seqs.values["ts"]
    time_idx = time_bucket(ts[:, None] - ts[None, :], buckets)  # unused by a model without time biases
    return one_user([getattr(history, f) for f in FIELDS], torch.from_numpy(time_idx)).numpy()
