"""The user model split for distributed training: sharded embeddings outside DeepSpeed, the dense tower inside.

    ids (KJT) --ShardedSparse (torchrec DMP, fused row-wise Adagrad in backward)--> embeddings (fp32)
          --grad 1/world, cast to bf16--> DenseTower (DeepSpeed engine: ZeRO, bf16, MoE, FP8) --> logits, aux

``DenseTower`` is the ``UserModel`` itself with its ``sparse`` module replaced by ``LookedUpEmbeddings``: the
model's own ``history_states`` / ``_summarize`` / ``score`` run unchanged and read the embeddings this step
already looked up. The next-event loss reads the ad table directly in the single-process model, which a sharded
table cannot offer; here the target of event i is the ad embedding of event i+1, already looked up for the
history (no second lookup: the embedding exchange is the largest message of a step), the shared negatives are
looked up with the other ids (feature ``next_negative`` on the ad table), and the loss is the same sampled
softmax.

Embedding gradients are summed across ranks by the sharded lookup while dense gradients are averaged by
DeepSpeed; scaling the embedding outputs' gradient by 1/world makes both the mean over the global batch.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models.architectures.l2_normalize import l2_normalize
from models.architectures.sampled_softmax import sampled_softmax_loss
from models.architectures.tokenizer import SparseArch, event_ids
from models.architectures.transforms import lengths
from models.architectures.user_model import UserModel
from models.training.batch import Batch, Events

NEXT_NEGATIVE = "next_negative"
HIST_AD = "hist_ad_id"  # the history's ad lookups: event i+1's row is the next-event target of event i


# ----------------------------------------------------------------------------------------------- sparse side
class ShardableSparse(SparseArch):
    """The user model's ``SparseArch`` plus the next-event features, with a forward that works once sharded
    (it never reads a table directly; the device comes from the ids)."""

    def __init__(self, source: SparseArch, dim: int, tables: set[str] | None = None):
        """``tables``: the subset of ``source``'s tables (and the features reading them) this module holds;
        None = all of them."""
        features = {**source.features, NEXT_NEGATIVE: "ad_id"}
        if tables is not None:
            features = {f: t for f, t in features.items() if t in tables}
        super().__init__(features, source.sizes, dim)
        mine = {f"embeddings.t_{t}.weight" for t in self.sizes}
        # same tables, same names: the same start
        self.ec.load_state_dict({k: v for k, v in source.ec.state_dict().items() if k in mine})

    def forward(
        self, ids: dict[str, tuple[torch.Tensor, torch.Tensor]], batch_size: int
    ) -> dict[str, torch.Tensor]:
        """Looks up the features of ``ids`` this module holds (others are left to the other part)."""
        ids = {k: v for k, v in ids.items() if k in self.features}
        if not ids:
            return {}
        device = next(iter(ids.values()))[0].device
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        no_lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        keys = list(self.features)
        values, lengths = [], []
        for key in keys:
            v, n = ids.get(key, (empty, no_lengths))
            size = self.sizes[self.features[key]]
            v = v.long()
            values.append(torch.where((v >= 0) & (v < size), v, torch.full_like(v, size)))  # unknown -> OOV
            lengths.append(n.long())
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
        )
        out = self.ec(kjt)
        return {key: out[key].values() for key in ids}


def next_event_sources(history: Events) -> torch.Tensor:
    """Positions whose event has a successor in the same sequence (the next-event loss predicts it)."""
    total = int(history.offsets[-1])
    has_next = torch.ones(total, dtype=torch.bool, device=history.offsets.device)
    if total:
        has_next[history.offsets[1:][history.lengths > 0] - 1] = False
    return has_next.nonzero().squeeze(1)


def sparse_ids(model: UserModel, batch: Batch, generator: torch.Generator | None = None):
    """Every id the step looks up, as feature -> (flat ids, per-user lengths), and the negatives' ids."""
    h, c = batch.history, batch.candidates
    b, device = h.batch_size, h.offsets.device
    ones = torch.ones(b, dtype=torch.int64, device=device)
    per_user = lengths(c.offsets)
    ids = {**event_ids("hist", h), "user_id": (batch.profile.user_id, ones)}
    ids |= {
        f"cand_{f}": (getattr(c, f), per_user) for f in ("ad_id", "advertiser_id", "category_id", "surface")
    }
    negatives = None
    cfg = model.cfg
    if model.training and cfg.next_event_weight > 0 and cfg.pooling == "transformer":
        num_ads = model.sparse_sizes["ad_id"] + 1  # + the OOV row, as the single-process model samples
        negatives = torch.randint(0, num_ads - 1, (cfg.num_negatives,), generator=generator).to(device)
        ids[NEXT_NEGATIVE] = (negatives, torch.tensor([cfg.num_negatives] + [0] * (b - 1), device=device))
    return ids, negatives


# ----------------------------------------------------------------------------------------------- dense side
class LookedUpEmbeddings(nn.Module):
    """Stands in for ``UserModel.sparse`` inside the engine: returns this step's looked-up embeddings."""

    def __init__(self):
        super().__init__()
        self.current: dict[str, torch.Tensor] = {}

    def forward(self, ids: dict, batch_size: int) -> dict[str, torch.Tensor]:
        return {key: self.current[key] for key in ids}


class DenseTower(nn.Module):
    """The user model without its embedding tables (those live in the sharded sparse module)."""

    def __init__(self, model: UserModel):
        super().__init__()
        model.sparse_sizes = dict(model.sparse.sizes)
        model.sparse = LookedUpEmbeddings()
        self.model = model

    def forward(
        self, emb: dict[str, torch.Tensor], batch: Batch, negatives: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        m.sparse.current = emb
        states, user_emb = m.history_states(batch.history, batch.profile.user_id)
        logits = m.score(m._summarize(states, batch.history.offsets, user_emb), batch.candidates)
        aux = states.new_zeros((), dtype=torch.float32)
        if NEXT_NEGATIVE in emb and negatives is not None:
            aux = self.next_event_loss(states, batch.history, emb[HIST_AD], emb[NEXT_NEGATIVE], negatives)
        return logits, aux

    def next_event_loss(self, states, history, hist_ad_emb, negative_emb, negatives) -> torch.Tensor:
        """``UserModel.next_event_loss`` on looked-up rows: state i scores the ad of event i+1 against negatives."""
        src = next_event_sources(history)
        if src.numel() == 0:
            return states.new_zeros((), dtype=torch.float32)
        target, target_emb = history.ad_id[src + 1], hist_ad_emb[src + 1]
        h = l2_normalize(self.model.next_proj(states[src]).float())
        size = self.model.sparse_sizes["ad_id"]
        target_row = torch.where((target >= 0) & (target < size), target, torch.full_like(target, size))
        return sampled_softmax_loss(
            h, l2_normalize(target_emb.float()), l2_normalize(negative_emb.float()), target_row, negatives,
            self.model.cfg.next_item_temperature,
        )  # fmt: skip


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def to_engine(emb: dict[str, torch.Tensor], world_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Sparse outputs as the engine's inputs: gradient averaged over ranks (not summed), engine dtype."""
    return {k: _ScaleGrad.apply(v, 1.0 / world_size).to(dtype) for k, v in emb.items()}


def cast_batch(batch: Batch, dtype: torch.dtype) -> Batch:
    """Float model inputs in the engine's dtype (labels stay fp32 for the loss)."""
    cands = replace(batch.candidates, dense=batch.candidates.dense.to(dtype))
    return replace(batch, candidates=cands)
