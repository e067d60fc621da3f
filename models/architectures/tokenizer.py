"""Dense tokenization: every input becomes a ``d_model`` token in one shared space.

- ``SparseArch``: all sparse ids (ad, advertiser, category, action, surface, user, time-gap bucket, ...)
  through one torchrec ``EmbeddingCollection`` over a ``KeyedJaggedTensor``. Features that name the same
  field (the history's ``ad_id`` and the candidate's) share one table, so they live in one vocabulary.
  Every feature is jagged over the same B users: history events (their lengths), candidates (per user), profile
  ids (one each). No padding anywhere. Models loaded for inference hold the same tables as ``PlainTables``
  (same state_dict, no torchrec; a serving process, which never shards or trains them, is ~175 MB smaller).
- ``EventTokenizer``: one history event = the sum of its field embeddings + its bucketed log time gap.
- ``DenseTokens``: each numeric feature x_f becomes the token ``x_f * w_f + b_f`` (one token per feature).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.training.batch import EVENT_ID_FIELDS, Events

GAP_TABLE = "gap_bucket"


def oov_ids(ids: torch.Tensor, size: int) -> torch.Tensor:
    """Ids of a table of ``size`` known rows: anything outside [0, size) -> the OOV row ``size`` (every table has
    one extra row for ids unseen in training: new ads at serving time)."""
    return torch.where((ids >= 0) & (ids < size), ids, size)


def gather_rows(ids: torch.Tensor, table: torch.Tensor, size: int) -> torch.Tensor:
    """The rows ``SparseArch`` returns for ``ids`` (the inference fast path: no KeyedJaggedTensor)."""
    return F.embedding(oov_ids(ids, size), table)


class PlainTables(nn.Module):
    """The tables of torchrec's ``EmbeddingCollection`` as plain ``nn.Embedding`` modules under the same names
    (state_dict keys ``embeddings.t_<table>.weight``): a model that is only read (serving, evaluation, embedding
    refreshes) needs neither torchrec's import nor its ``KeyedJaggedTensor``."""

    def __init__(self, sizes: dict[str, int], dim: int):
        super().__init__()
        self.embeddings = nn.ModuleDict({f"t_{t}": nn.Embedding(size + 1, dim) for t, size in sizes.items()})


class SparseArch(nn.Module):
    """``features``: feature name -> table (field) name; ``table_sizes``: field -> ids (max id + 1).

    Each table gets one extra row for ids outside the training vocabulary (new ads at serving time).
    Table names are prefixed (``t_``): a table named like a dict method (``items``) breaks torchrec.
    ``torchrec=False`` holds the tables as ``PlainTables`` (inference: the same rows, the same state_dict; the
    distributed trainer's sharding and the fused sparse optimizer need torchrec's module).
    """

    def __init__(
        self, features: dict[str, str], table_sizes: dict[str, int], dim: int, torchrec: bool = True
    ):
        super().__init__()
        missing = sorted({t for t in features.values() if t not in table_sizes})
        if missing:
            raise ValueError(f"no vocabulary size for table(s) {missing}")
        self.features = dict(features)
        self.sizes = {t: int(table_sizes[t]) for t in sorted(set(features.values()))}
        self.ec = self._collection(dim) if torchrec else PlainTables(self.sizes, dim)
        self.reset_parameters(dim)

    def _collection(self, dim: int) -> nn.Module:
        from torchrec.modules.embedding_configs import EmbeddingConfig
        from torchrec.modules.embedding_modules import EmbeddingCollection

        tables = [
            EmbeddingConfig(
                name=f"t_{table}",
                embedding_dim=dim,
                num_embeddings=size + 1,
                feature_names=[f for f, t in self.features.items() if t == table],
            )
            for table, size in self.sizes.items()
        ]
        return EmbeddingCollection(tables=tables, device=torch.device("cpu"))

    def reset_parameters(self, dim: int, std: float = 0.0) -> None:
        """``std`` 0: each table starts in its own block of dimensions. A token that sums several fields (an
        event, a candidate) then starts as their concatenation, and the dot product of two such tokens counts
        the fields whose ids agree, instead of being buried under random cross-field terms. Training mixes
        freely. ``std`` > 0: every row N(0, std) over all dimensions."""
        names = list(self.sizes)
        for i, table in enumerate(names):
            weight = self.table(table)
            lo, hi = i * dim // len(names), (i + 1) * dim // len(names)
            with torch.no_grad():
                if std > 0:
                    weight.normal_(std=std)
                    continue
                weight.zero_()
                weight[:, lo:hi].normal_(std=1.0)

    def table(self, field: str) -> torch.nn.Parameter:
        return self.ec.embeddings[f"t_{field}"].weight

    def forward(
        self, ids: dict[str, tuple[torch.Tensor, torch.Tensor]], batch_size: int
    ) -> dict[str, torch.Tensor]:
        """``ids``: feature -> (flat ids, per-user lengths). Features left out get zero lengths (the EC needs
        every feature). Returns feature -> (total, dim) embeddings."""
        unknown = set(ids) - set(self.features)
        if unknown:
            raise KeyError(f"unknown sparse feature(s) {sorted(unknown)}; known: {sorted(self.features)}")
        if isinstance(self.ec, PlainTables):  # what the collection returns: each id's row, in order
            return {key: self._rows(key, v) for key, (v, _) in ids.items()}
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        device = self.table(next(iter(self.sizes))).device
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        no_lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        keys = list(self.features)
        values, lengths = [], []
        for key in keys:
            v, n = ids.get(key, (empty, no_lengths))
            size = self.sizes[self.features[key]]
            values.append(oov_ids(v.long(), size))
            lengths.append(n.long())
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
        )
        out = self.ec(kjt)
        return {key: out[key].values() for key in ids}

    def _rows(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        table = self.features[feature]
        return gather_rows(ids.long(), self.table(table), self.sizes[table])


def event_features(prefix: str) -> dict[str, str]:
    """Sparse features of one history event stream, named ``<prefix>_<field>``."""
    feats = {f"{prefix}_{f}": f for f in EVENT_ID_FIELDS}
    feats[f"{prefix}_{GAP_TABLE}"] = GAP_TABLE
    return feats


def event_ids(prefix: str, events: Events) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    lengths = events.lengths
    ids = {f"{prefix}_{f}": (getattr(events, f), lengths) for f in EVENT_ID_FIELDS}
    ids[f"{prefix}_{GAP_TABLE}"] = (events.gap_bucket, lengths)
    return ids


class EventTokenizer(nn.Module):
    """One token per event: sum of its field embeddings (ad, action, surface, category, advertiser, gap)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, emb: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        """Fields missing from ``emb`` are left out; ``<prefix>_attributes`` (item attributes) is added when given."""
        fields = (*EVENT_ID_FIELDS, GAP_TABLE, "attributes")
        tokens = sum(emb[f"{prefix}_{f}"] for f in fields if f"{prefix}_{f}" in emb)
        return self.norm(tokens)


class DenseTokens(nn.Module):
    """(N, F) normalized numbers -> (N, F, dim): one token per feature, ``x_f * w_f + b_f``."""

    def __init__(self, num_features: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_features, dim) * 0.05)
        self.bias = nn.Parameter(torch.zeros(num_features, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., None] * self.weight + self.bias
