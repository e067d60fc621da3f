"""A request's retrieval query: fresh where the user model allows it, else the cached one, else cold start.

- **fresh**: the user model that computed the index's vectors (``user_model.json`` of the refresh folder, loaded
  with the snapshot) over the user's recent events as the request read them for the ranker (one online read per
  request): the events older than the ranker's ``fresh_cutoff`` (``serving.inputs.fresh_window``), the newest
  ``max_history`` of them, through ``models.embeddings.sequences.query_vectors``, the refresh's own computation
  (for one user, the model's TorchScript module: ``models.inference.one_user_query``, equal to the eager path).
  The online list holds a user's newest ``features.schema.ONLINE_LIST_EVENTS`` events: a model with a longer window
  reads that many (the answer says how many: ``query_events``).
- **cached**: the user's query written by the last refresh (the state at the end of its day).
- **cold_start**: the catalog's mean user query (a user the refresh has not seen).

Why the fresh query was not used is counted (``gemflow_retrieval_query_fallbacks``): ``no_model`` (the folder
records none, or it could not be loaded), ``no_next_item_head``, ``no_features`` (the store read failed or timed
out), ``no_events`` (nothing visible before the cutoff), ``incomplete_events`` (the list lacks a field the model
reads), ``error`` (the computation failed; logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from features.recent_events import LIST_COLUMNS
from features.schema import HISTORY_FIELDS
from models.embeddings.ad_vectors import UserModelRecord
from models.embeddings.sequences import UserSequences, query_vectors
from models.inference.bundle import ModelBundle
from serving.inputs import fresh_window
from serving.user_features import UserFeatures

log = logging.getLogger(__name__)

QUERY_KINDS = ("fresh", "cached", "cold_start")
# the model's event fields <- the online list's columns (``features.recent_events``: recent_ts in seconds)
EVENT_COLUMNS = {field: column for column, field in LIST_COLUMNS.items() if field in HISTORY_FIELDS} | {
    "ts": "recent_ts"
}


@dataclass(frozen=True)
class QueryModel:
    """The user model that computed a snapshot's vectors, kept to compute fresh queries with."""

    bundle: ModelBundle
    version: str  # the version its vectors carry (``UserModelRecord.model_version``)
    one_user: torch.jit.ScriptModule | None = None  # its one-user query, scripted (None: the eager path)

    @property
    def max_history(self) -> int:
        return int(self.bundle.cfg.max_history)


@dataclass(frozen=True)
class Query:
    vector: np.ndarray  # (d,) float32
    version: str  # the user-model version that computed it
    kind: str  # fresh | cached | cold_start
    fallback: str | None = None  # why it is not fresh (None: fresh, or fresh queries are off)
    events: int = 0  # events a fresh query read


def load_query_model(
    record: UserModelRecord, tracking_uri: str = "", ws=None
) -> tuple[QueryModel | None, str]:
    """(the recorded model, "") or (None, why not). The caller compares ``QueryModel.version`` with the index's."""
    from models.embeddings.refresh import load_champion

    try:
        champion = load_champion(record.model_uri, tracking_uri, ws)
    except (OSError, LookupError, ValueError) as err:
        log.warning(
            "retrieval: cannot load the user model %s: %s (cached queries only)", record.model_uri, err
        )
        return None, "no_model"
    if getattr(champion.bundle.cfg, "objective", "") != "next_item":
        return None, "no_next_item_head"
    return QueryModel(champion.bundle, champion.version, scripted_query(champion.bundle.model)), ""


def scripted_query(model) -> torch.jit.ScriptModule | None:
    """The model's one-user query through TorchScript (``models.inference.one_user_query``): a quarter of the eager
    path's time and one GIL release instead of hundreds. None (the eager path answers) where it does not apply."""
    from models.inference.one_user_query import script_query

    try:
        return script_query(model)
    except Exception:  # noqa: BLE001 (the eager path computes the same query)
        log.exception("retrieval: cannot script the user model's query; fresh queries run eagerly")
        return None


def warm_up(model: QueryModel) -> None:
    """One query of a made-up two-event user: the first one in a process pays the lazy initialisations and the
    attribute table (18 of 20 ms on Toys), before a request would."""
    recent = {c: np.zeros(2, np.int64) for c in EVENT_COLUMNS.values()} | {"recent_ts": np.array([1, 2])}
    fresh_query(model, 0, UserFeatures(None, None, None, recent, None, None), 10.0, 0)


def fresh_sequence(
    user_id: int, recent: dict[str, np.ndarray], request_ts: float, max_history: int, delay_s: int | None
) -> UserSequences | str:
    """The user's events a fresh query reads (one user), or why there are none."""
    missing = [c for c in EVENT_COLUMNS.values() if c not in recent]
    if missing:
        return "incomplete_events"
    take = fresh_window(recent, request_ts, max_history, delay_s)
    values = {f: np.ascontiguousarray(recent[c][take], np.int64) for f, c in EVENT_COLUMNS.items()}
    n = len(values["ts"])
    if n == 0:
        return "no_events"
    return UserSequences(np.array([user_id], np.int64), np.array([0, n], np.int64), values)


def fresh_query(
    model: QueryModel, user_id: int, feats: UserFeatures | None, request_ts: float, delay_s: int | None
) -> Query | str:
    """The user model's query over the request's events, or why it cannot be computed."""
    if feats is None:
        return "no_features"
    if feats.recent is None:
        return "no_events"
    seqs = fresh_sequence(user_id, feats.recent, request_ts, model.max_history, delay_s)
    if isinstance(seqs, str):
        return seqs
    try:
        vector = query_vectors(model.bundle, seqs, one_user=model.one_user)[0]
    except Exception:  # noqa: BLE001 (the cached query answers; the failure is logged and counted)
        log.exception("retrieval: the fresh query of user %d failed", user_id)
        return "error"
    return Query(vector, model.version, "fresh", events=int(seqs.offsets[-1]))
