"""Retrieval vectors from the user model's next-item head: one per ad (item side) and one per user (query side).

The next-item objective scores ``query(state after the user's last event) . item_vectors(ad)`` (cosine /
temperature, ``models.architectures.user_model``): exactly the inner product an ANN index searches. Both sides carry the
user-model version that computed them (``gem-user-model/3``, as the cached user embeddings do), and
``serving.retrieval`` refuses to search one version's index with another version's query.

Written by the embedding refresh next to the user embeddings, one folder per day and version:
``ws.offline("retrieval", D)/ad_vectors.parquet`` (ad_id, vector, model_version) and ``user_queries.parquet``
(user_id, vector, model_version: each active user's query as of the end of D), and ``user_model.json``: the
model version and pinned URI that computed both, which the server loads to compute a request's fresh query
(``serving.retrieval.query``). All read by ``serving.retrieval``.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from models.inference.bundle import ModelBundle
from models.training.batch import Events

RETRIEVAL_TABLE = "retrieval"
AD_VECTOR_FILE = "ad_vectors.parquet"
USER_QUERY_FILE = "user_queries.parquet"
USER_MODEL_FILE = "user_model.json"


@dataclass(frozen=True)
class AdVectors:
    ad_ids: np.ndarray  # (n,) int64 raw ad ids, ascending
    vectors: np.ndarray  # (n, d) float32, the model's item vectors (normalized)
    model_version: str  # the user-model version that computed them

    def __post_init__(self):
        if self.vectors.ndim != 2 or len(self.ad_ids) != len(self.vectors):
            raise ValueError(f"{len(self.ad_ids)} ad ids for vectors of shape {self.vectors.shape}")
        if not self.model_version:
            raise ValueError("ad vectors need the user-model version that computed them")

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]


@dataclass(frozen=True)
class UserQueries(AdVectors):
    """The same shape, keyed by user: ``ad_ids`` holds raw user ids (ascending)."""

    def lookup(self, user_id: int) -> np.ndarray | None:
        at = int(np.searchsorted(self.ad_ids, user_id))
        return self.vectors[at] if at < len(self.ad_ids) and self.ad_ids[at] == user_id else None


@dataclass(frozen=True)
class UserModelRecord:
    """Which user model computed a retrieval folder's vectors."""

    model_version: str  # what the vectors carry: "gem-user-model/3" or "local/<run>"
    model_uri: str  # pinned: models:/NAME/VERSION (never an alias) or the model file's absolute path


def _check_next_item(bundle: ModelBundle) -> None:
    if bundle.kind != "user" or getattr(bundle.cfg, "objective", "") != "next_item":
        raise ValueError(
            "retrieval vectors come from a user model trained with objective=next_item "
            f"(got a {bundle.kind} model, objective {getattr(bundle.cfg, 'objective', None)!r})"
        )


def _in_eval(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode, switched only when it is not: ``eval()`` walks every module (~1 ms a call, a third
    of a fresh query's cost at request time)."""
    return model.eval() if model.training else model


@torch.inference_mode()
def ad_vectors(bundle: ModelBundle, version: str) -> AdVectors:
    """Every ad the model knows -> its item vector (id row + category, advertiser and attribute tokens where the
    model reads item attributes): the very vectors its next-item score multiplies."""
    _check_next_item(bundle)
    model = _in_eval(bundle.model)
    vocab = bundle.vocabularies.get("ad_id")
    ad_ids = vocab.ids if vocab is not None else np.arange(model.num_items, dtype=np.int64)
    rows = vocab.map(ad_ids) if vocab is not None else ad_ids
    vectors = model.item_vectors(torch.from_numpy(rows)).float().numpy()
    return AdVectors(np.ascontiguousarray(ad_ids, np.int64), np.ascontiguousarray(vectors), version)


@torch.inference_mode()
def user_queries(bundle: ModelBundle, history: Events, user_id: torch.Tensor) -> np.ndarray:
    """(B, d) float32 next-item queries: the state after each user's last event (already mapped to the model's
    rows, ``models.embeddings.sequences.model_inputs``). A user without history gets zeros (every ad ties)."""
    _check_next_item(bundle)
    model = _in_eval(bundle.model)
    states = model.sequence_states(history, user_id)
    if not len(states):
        return np.zeros((history.batch_size, bundle.cfg.d_model), np.float32)
    query = model.query(states[(history.offsets[1:] - 1).clamp(min=0)])
    query = torch.where((history.lengths > 0)[:, None], query, torch.zeros_like(query))
    return query.float().numpy()


# ----------------------------------------------------------------------------------------------- files
def write_ad_vectors(
    folder: Path, vecs: AdVectors, day: dt.date | None = None, name: str = AD_VECTOR_FILE
) -> Path:
    """One parquet file (atomic rename): the index builder reads it whole. ``UserQueries`` go to their own file."""
    folder.mkdir(parents=True, exist_ok=True)
    key = "user_id" if isinstance(vecs, UserQueries) else "ad_id"
    table = pa.table(
        {
            key: pa.array(vecs.ad_ids, pa.int64()),
            "vector": pa.FixedSizeListArray.from_arrays(
                pa.array(vecs.vectors.ravel(), pa.float32()), vecs.dim
            ),
            "model_version": pa.array([vecs.model_version] * len(vecs.ad_ids), pa.string()),
        },
        metadata={"model_version": vecs.model_version, "day": day.isoformat() if day else ""},
    )
    path = folder / name
    tmp = folder / f".{name}.tmp"
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path


def read_ad_vectors(path: Path, name: str = AD_VECTOR_FILE) -> AdVectors:
    """``name`` = USER_QUERY_FILE reads the user queries (as ``UserQueries``)."""
    table = pq.read_table(path if path.suffix == ".parquet" else path / name)
    versions = set(table.column("model_version").unique().to_pylist())
    if len(versions) != 1:
        raise ValueError(f"{path} mixes user-model versions {sorted(versions)}; one file is one version")
    column = table.column("vector").combine_chunks()
    dim = column.type.list_size
    vectors = column.values.to_numpy().reshape(-1, dim).astype(np.float32, copy=False)
    if "user_id" in table.column_names:
        return UserQueries(table.column("user_id").to_numpy().astype(np.int64), vectors, versions.pop())
    return AdVectors(table.column("ad_id").to_numpy().astype(np.int64), vectors, versions.pop())


def write_user_model_record(folder: Path, record: UserModelRecord) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path, tmp = folder / USER_MODEL_FILE, folder / f".{USER_MODEL_FILE}.tmp"
    tmp.write_text(json.dumps(asdict(record), indent=2))
    tmp.replace(path)
    return path


def read_user_model_record(folder: Path) -> UserModelRecord | None:
    """None for a folder without one (written before the record existed, or by hand)."""
    path = folder / USER_MODEL_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return UserModelRecord(str(data["model_version"]), str(data["model_uri"]))
