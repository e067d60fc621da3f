"""Evaluation of trained models: NE/AUC/calibration on a split, and leave-one-out ranking for positive-only
logs (MovieLens-style: each user's last positive is the test item, the second-last the validation item).

Leave-one-out (``models.training.leave_one_out``, the one protocol): the held-out positive and ``num_negatives`` ads the
user never interacted with (the same fixed lists every command and bench ranks) are scored against the user's history as of the positive;
HR@K, NDCG@K and MRR follow from the positive's rank. Every candidate, the positive included, takes its ad
attributes from one per-ad table (each ad's last row in the train split), so the positive's own row leaks
nothing. The user side is computed once per user and shared by its 1 + ``num_negatives`` candidates.

Two scorers rank the lists of a user model: ``click`` (its p_click head: trained on which *shown* items a user
liked) and ``next_event`` (its next-event head: the cosine of the last history state, projected, with each
candidate's ad embedding — the sampled-softmax retrieval score it was trained with, i.e. which item comes next).
The protocol's negatives are items the user never touched, so it asks the second question; on MovieLens, where
every impression is a rated (watched) movie, the click head never saw an unwatched item as a negative.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models.architectures.transforms import lengths
from models.inference.bundle import ModelBundle, batches, embed_examples, load_bundle
from models.training.batch import CANDIDATE_ID_FIELDS, Candidates
from models.training.batch_builder import BatchBuilder
from models.training.data import TrainingSet, leave_one_out_split
from models.training.leave_one_out import negative_lists
from models.training.metrics import rank_metrics


@dataclass
class LooLists:
    rows: np.ndarray  # (U,) the held-out positive example of each user
    items: np.ndarray  # (U, 1 + negatives) ad ids, column 0 = the positive


def loo_lists(data: TrainingSet, split: str = "test", num_negatives: int = 99, seed: int = 0) -> LooLists:
    """The candidate lists of the leave-one-out protocol for ``split`` ("test" or "valid"): the held-out
    positive and ``models.training.leave_one_out.negative_lists`` (the lists every command and bench ranks)."""
    ex = data.examples
    labels = leave_one_out_split(ex)
    rows = np.flatnonzero((labels == split) & (ex["click"].to_numpy() > 0))
    negatives = negative_lists(data, ex["user_row"].to_numpy(np.int64)[rows], num_negatives, seed)
    return LooLists(rows, np.concatenate([ex["ad_id"].to_numpy(np.int64)[rows, None], negatives], 1))


def ad_table(data: TrainingSet, builder: BatchBuilder) -> dict[int, int]:
    """ad id -> the example row whose attributes stand for that ad (its last train row, else its last row)."""
    ex = data.examples
    is_train = (leave_one_out_split(ex) == "train").astype(int)
    order = np.lexsort((ex["ts"].to_numpy(), is_train))  # train rows last, latest last
    return dict(zip(ex["ad_id"].to_numpy()[order].tolist(), order.tolist(), strict=True))


SCORERS = ("click", "next_event")


@torch.no_grad()
def score_lists(
    bundle: ModelBundle,
    data: TrainingSet,
    builder: BatchBuilder,
    lists: LooLists,
    batch_users: int = 64,
    scorer: str = "click",
):
    """(U, 1 + negatives) scores of every candidate list (one user-side computation per user): p_click, or the
    next-event retrieval score (user models with a trained next-event head only)."""
    model = bundle.model
    model.eval()
    if scorer not in SCORERS:
        raise ValueError(f"scorer must be one of {SCORERS}, got {scorer!r}")
    if scorer == "next_event":
        _check_next_event_head(bundle)
        return _next_event_scores(model, builder, lists, batch_users)
    train_labels = data.examples.loc[leave_one_out_split(data.examples) == "train", "click"]
    if len(train_labels) and (train_labels > 0).all():
        raise ValueError(
            "the click scorer ranks with a click head, and on a positive-only log that head only ever saw positives: "
            "it ties every candidate. Rank with a next-item model (bench/sequential.py, docs/model-results-sequential.md)"
        )
    table = ad_table(data, builder)
    out = []
    for chunk in batches(np.arange(len(lists.rows)), batch_users, "leave-one-out"):
        rows = lists.rows[chunk]
        batch = builder(rows)
        items = lists.items[chunk]
        attr_rows = np.vectorize(table.__getitem__)(items).ravel()
        cands = builder.data.candidates(attr_rows, builder.dense)
        cands.surface = batch.candidates.surface.repeat_interleave(items.shape[1])  # the request's surface
        cands = Candidates(
            **{f: getattr(cands, f) for f in (*CANDIDATE_ID_FIELDS, "dense")},
            offsets=torch.arange(len(rows) + 1) * items.shape[1],
        )
        if bundle.kind == "user":
            user = model.encode_user(batch.history, batch.profile.user_id)
            logits = model.score(user, cands)
        else:
            side = model.user_side(batch.history, batch.profile, batch.user_tokens, batch.user_token_mask)
            logits = model.score(side, cands)
        out.append(torch.sigmoid(logits[:, 0]).view(len(rows), -1))
    return torch.cat(out).numpy()


def _check_next_event_head(bundle: ModelBundle) -> None:
    cfg = bundle.cfg
    if bundle.kind != "user":
        raise ValueError("the next_event scorer needs a user model (a ranker has no next-event head)")
    if cfg.pooling != "transformer" or cfg.next_event_weight <= 0:
        raise ValueError(
            "the next_event scorer needs a user model trained with its next-event loss "
            f"(pooling 'transformer', next_event_weight > 0), got pooling {cfg.pooling!r}, "
            f"next_event_weight {cfg.next_event_weight}"
        )


def _next_event_scores(model, builder: BatchBuilder, lists: LooLists, batch_users: int) -> np.ndarray:
    table = F.normalize(model.sparse.table("ad_id"), dim=-1)
    out = []
    for chunk in batches(np.arange(len(lists.rows)), batch_users, "leave-one-out (next event)"):
        batch = builder(lists.rows[chunk])
        states, _ = model.history_states(batch.history, batch.profile.user_id)
        offsets = batch.history.offsets
        counts = lengths(offsets)
        if len(states):
            last = states[(offsets[1:] - 1).clamp(min=0)]
        else:  # every history in the chunk is empty
            last = states.new_zeros(len(chunk), model.cfg.d_model)
        query = F.normalize(model.next_proj(last), dim=-1)  # what the state at the last event predicts next
        ids = torch.from_numpy(lists.items[chunk]).clamp(0, table.shape[0] - 1)
        scores = torch.einsum("ud,ucd->uc", query, table[ids])
        out.append(torch.where(counts[:, None] > 0, scores, torch.zeros_like(scores)))  # no history: all tie
    return torch.cat(out).numpy()


def leave_one_out(
    bundle: ModelBundle, data: TrainingSet, builder: BatchBuilder, *, split: str = "test", num_negatives: int = 99,
    seed: int = 0, ks: tuple[int, ...] = (10,), scorer: str = "click",
) -> dict[str, float]:  # fmt: skip
    lists = loo_lists(data, split, num_negatives, seed)
    scores = score_lists(bundle, data, builder, lists, scorer=scorer)
    return rank_metrics(_held_out(scores, lists), scores[:, 1:], ks)


def _held_out(scores: np.ndarray, lists: LooLists) -> np.ndarray:
    """The held-out item's scores; an item outside the vocabulary (-1) is a miss (``models.training.leave_one_out``)."""
    return np.where(lists.items[:, 0] < 0, -np.inf, scores[:, 0])


def popularity_leave_one_out(
    data: TrainingSet,
    *,
    split: str = "test",
    num_negatives: int = 99,
    seed: int = 0,
    ks: tuple[int, ...] = (10,),
) -> dict[str, float]:
    """Baseline: rank by the number of positives each ad got in the train rows."""
    lists = loo_lists(data, split, num_negatives, seed)
    ex = data.examples
    train = (leave_one_out_split(ex) == "train") & (ex["click"].to_numpy() > 0)
    counts = ex.loc[train, "ad_id"].value_counts()
    scores = counts.reindex(lists.items.ravel()).fillna(0).to_numpy().reshape(lists.items.shape)
    return rank_metrics(_held_out(scores, lists), scores[:, 1:], ks)


def load_for_evaluation(run_dir: str | Path, training_set: str | Path, fresh_as_of: str = "served"):
    """The trained bundle, the training set and a batch builder that reads it the way the model was trained.
    ``fresh_as_of`` (a ranker): "served" reads the fresh events the online store serves with the event path (the
    trained rule), "day" those of a store written once a day (each example's history before its day's start)."""
    if fresh_as_of not in ("served", "day"):
        raise ValueError(f"fresh_as_of must be 'served' or 'day', got {fresh_as_of!r}")
    bundle = load_bundle(run_dir)
    data = TrainingSet(Path(training_set), require_ranker=bundle.kind == "ranker")
    data = data.as_seen_by(bundle.vocabularies)
    cfg = bundle.cfg
    if bundle.kind == "user":
        builder = BatchBuilder(
            data, bundle.dense, history_len=cfg.max_history, time_buckets=cfg.time_buckets, gap_to="previous"
        )
    else:
        emb, present = None, None
        if cfg.use_user_tokens and bundle.user_token_dim:
            if cfg.user_model:  # the ranker was trained on tokens embedded by this user model
                emb = embed_examples(load_bundle(cfg.user_model), data)
                present = np.ones(len(emb), bool)
            else:
                emb, present, _ = data.user_embeddings()
        builder = BatchBuilder(
            data, bundle.dense, history_len=cfg.recent_events, time_buckets=cfg.time_buckets, gap_to="request",
            user_embeddings=emb, user_present=present, num_user_tokens=cfg.num_user_tokens,
            fresh_delay_s=cfg.fresh_delay_s, fresh_as_of_day=fresh_as_of == "day",
        )  # fmt: skip
    return bundle, data, builder
