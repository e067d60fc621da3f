"""The offline user model: a deep transformer over the jagged history -> K cached user tokens.

    history events --EventTokenizer--> tokens --L x TransformerBlock (relative pos/time bias)--> states
    K learned summary queries (+ the user id embedding) --cross-attention over states--> K user tokens
    (= the cached user embedding, ``encode_user``: the candidate never enters it)

Training head (``forward``): the candidate token attends over the K user tokens (target-aware), an MLP gives
click and conversion logits. Optional auxiliary loss: next-ad prediction on the history with a sampled softmax
(causal attention, so position i sees only events <= i).
Ablation ``pooling="mean"``: the user token is the mean of the history tokens (no attention at all).

Next-item objective (``objective="next_item"``, positive-only logs): the state after each event, projected and
normalized, scores every item by cosine / temperature (``sequence_states`` -> ``query`` . ``item_vectors``);
the trainer puts a softmax over the catalog on it. With ``item_attributes="all"`` every attribute of an item
(``items.parquet``) is mean-pooled into one more field of its event tokens and of its item vector.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.architectures.l2_normalize import l2_normalize
from models.architectures.layers import (
    CrossAttention,
    TargetAwareBlock,
    TransformerBlock,
    mlp_head,
    segment_cumulative_mean,
    segment_mean,
)
from models.architectures.sampled_softmax import sampled_softmax_loss
from models.architectures.tokenizer import GAP_TABLE, EventTokenizer, SparseArch, event_features, event_ids
from models.architectures.transforms import lengths
from models.config import UserModelConfig
from models.sequential.data import ItemAttributes
from models.training.batch import CANDIDATE_ID_FIELDS, Batch, Candidates, Events


def user_model_tables(cfg: UserModelConfig, vocab: dict[str, int]) -> dict[str, int]:
    return {**vocab, GAP_TABLE: cfg.time_buckets}


class UserModel(nn.Module):
    def __init__(
        self,
        cfg: UserModelConfig,
        vocab: dict[str, int],
        num_dense: int,
        items: ItemAttributes | None = None,
        torchrec: bool = True,
    ):
        """``torchrec=False``: the embedding tables without torchrec (a model loaded to be read: ``SparseArch``)."""
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        features = {
            **event_features("hist"),
            **{f"cand_{f}": f for f in CANDIDATE_ID_FIELDS},
            "user_id": "user_id",
        }
        self.sparse = SparseArch(features, user_model_tables(cfg, vocab), d, torchrec)
        if cfg.embedding_init == "normal":
            self.sparse.reset_parameters(d, std=0.05)
        self.items = items if cfg.item_attributes == "all" else None
        if cfg.item_attributes == "all":
            if items is None:
                raise ValueError("user_model.item_attributes=all needs the training set's items.parquet")
            for name, value in items.to_payload().items():  # saved in the bundle, not in the state dict
                self.register_buffer(f"item_{name}", value, persistent=False)
            self.register_buffer("item_attribute_matrix", items.mean_matrix(), persistent=False)
            self.attributes = nn.Embedding(items.num_attributes, d)
            nn.init.normal_(self.attributes.weight, std=0.05)
        self.events = EventTokenizer(d)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                d, cfg.num_heads, cfg.ffn_mult, cfg.dropout, causal=cfg.causal, max_rel_pos=cfg.max_rel_pos,
                time_buckets=cfg.time_buckets, backend=cfg.attention_backend,
            )
            for _ in range(cfg.num_layers if cfg.pooling == "transformer" else 0)
        )  # fmt: skip
        self.norm = nn.LayerNorm(d)
        k = cfg.num_user_tokens if cfg.pooling == "transformer" else 1
        self.summary_queries = nn.Parameter(torch.randn(k, d) * 0.05)
        self.summary = CrossAttention(d, cfg.num_heads, cfg.attention_backend)
        # training head: candidate -> target-aware attention over the user tokens -> click, conversion
        self.cand_dense_proj = nn.Linear(num_dense, d) if num_dense else None  # next-item sets have none
        self.cand_norm = nn.LayerNorm(d)
        self.target = TargetAwareBlock(d, cfg.num_heads, cfg.ffn_mult, cfg.dropout, cfg.attention_backend)
        self.head = mlp_head(3 * d, 2 * d, 2, cfg.dropout)
        self.next_proj = nn.Linear(d, d)

    @property
    def num_user_tokens(self) -> int:
        return self.summary_queries.shape[0]

    # ------------------------------------------------------------------------------------- user side only
    def history_states(self, history: Events, user_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(total, d) final per-event states and the (B, d) user-id embedding."""
        b = history.batch_size
        ones = torch.ones(b, dtype=torch.int64, device=user_id.device)
        emb = self.sparse({**event_ids("hist", history), "user_id": (user_id, ones)}, b)
        if self.items is not None:
            emb["hist_attributes"] = self.attribute_tokens(history.ad_id)
        x = F.dropout(self.events(emb, "hist"), self.cfg.dropout, self.training)  # SASRec's embedding dropout
        for block in self.blocks:
            x = block(x, history.offsets, history.ts)
        return self.norm(x), emb["user_id"]

    # ------------------------------------------------------------------------------------- next item
    @property
    def num_items(self) -> int:
        return self.sparse.table("ad_id").shape[0] - 1  # the last row is the out-of-vocabulary one

    def attribute_table(self) -> torch.Tensor:
        """(num_ads, d) every ad's mean attribute embedding (zeros for an ad without any): one sparse
        (ads x attributes) matmul, cheaper forward and backward than a gather per token."""
        return torch.sparse.mm(self.item_attribute_matrix, self.attributes.weight)

    def attribute_tokens(self, ad_id: torch.Tensor) -> torch.Tensor:
        inference = not self.training and not torch.is_grad_enabled()
        table = self.frozen_attribute_table() if inference else self.attribute_table()
        return F.embedding(ad_id.clamp(0, table.shape[0] - 1), table)

    def frozen_attribute_table(self) -> torch.Tensor:
        """``attribute_table()`` kept while the attribute weights stay the same (their storage and version): a
        request's fresh retrieval query reads a few events, and the table is a matmul over the whole catalog
        (1.9 of 2.5 ms per query on Toys). Costs one (num_ads, d) table of memory, like the ad vectors."""
        weight = self.attributes.weight
        key = (weight.data_ptr(), weight._version)
        cached = self.__dict__.get("_frozen_attributes")
        if cached is None or cached[0] != key:
            with (
                torch.inference_mode(False),
                torch.no_grad(),
            ):  # a plain tensor: usable in and out of inference
                cached = (key, self.attribute_table())
            self.__dict__["_frozen_attributes"] = cached  # not a module attribute: never in the state dict
        return cached[1]

    def sequence_states(self, history: Events, user_id: torch.Tensor) -> torch.Tensor:
        """(total, d) what the user looks like right after each event (causal: events <= itself only)."""
        if self.cfg.pooling == "mean":
            b = history.batch_size
            emb = self.sparse(event_ids("hist", history), b)
            if self.items is not None:
                emb["hist_attributes"] = self.attribute_tokens(history.ad_id)
            return segment_cumulative_mean(self.events(emb, "hist"), history.offsets)
        return self.history_states(history, user_id)[0]

    def query(self, states: torch.Tensor) -> torch.Tensor:
        """States -> next-item queries; a query . item vector is cosine / temperature."""
        return l2_normalize(self.next_proj(states)) / self.cfg.next_item_temperature

    def item_vectors(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """(n, d) normalized item-side vectors of ``ids`` (every ad when None): the ad's own row, plus its
        category, advertiser and attribute tokens where the model reads item attributes (in training, the own
        row dropped with probability ``item_id_dropout``)."""
        table = self.sparse.table("ad_id")
        if ids is None:
            vec = table[: self.num_items]  # a slice: no gather, no scatter in backward
        else:
            ids = ids.clamp(0, self.num_items)
            vec = F.embedding(ids, table)
        if self.items is not None:
            if self.training and self.cfg.item_id_dropout > 0:
                keep = torch.rand(vec.shape[:-1], device=vec.device) >= self.cfg.item_id_dropout
                vec = vec * keep.unsqueeze(-1).to(vec.dtype)  # unscaled: the vector is normalized after
            known = None if ids is None else ids.clamp(max=self.item_category.numel() - 1)

            def pick(per_ad: torch.Tensor) -> torch.Tensor:
                return per_ad if known is None else per_ad[known]

            vec = (
                vec
                + F.embedding(pick(self.item_category), self.sparse.table("category_id"))
                + F.embedding(pick(self.item_advertiser), self.sparse.table("advertiser_id"))
                + pick(self.attribute_table())
            )
        return l2_normalize(vec)

    def encode_user(self, history: Events, user_id: torch.Tensor) -> torch.Tensor:
        """(B, K, d) user tokens: the cached, candidate-independent user embedding."""
        states, user_emb = self.history_states(history, user_id)
        return self._summarize(states, history.offsets, user_emb)

    def _summarize(self, states, offsets, user_emb) -> torch.Tensor:
        b, k, d = offsets.numel() - 1, self.num_user_tokens, self.cfg.d_model
        queries = (self.summary_queries[None] + user_emb[:, None]).reshape(b * k, d)
        if self.cfg.pooling == "mean":
            return (queries + segment_mean(states, offsets)).view(b, k, d)
        q_offsets = torch.arange(b + 1, device=offsets.device) * k
        read = self.summary(queries, q_offsets, self.summary.project_kv(states), offsets)
        # the mean of the states is a residual path every token carries: from step 0 the cached tokens hold
        # the whole history's profile (long-term interests), and the K queries learn what to add on top of it
        pooled = segment_mean(states, offsets).repeat_interleave(k, 0)
        return (queries + read + pooled).view(b, k, d)

    # ------------------------------------------------------------------------------------- training head
    def candidate_tokens(self, cands: Candidates, batch_size: int) -> torch.Tensor:
        per_user = lengths(cands.offsets)
        ids = {f"cand_{f}": (getattr(cands, f), per_user) for f in CANDIDATE_ID_FIELDS}
        emb = self.sparse(ids, batch_size)
        # like an event token: the sum of its id embeddings (one shared space), plus its dense features
        ids = sum(emb[f"cand_{f}"] for f in CANDIDATE_ID_FIELDS)
        dense = self.cand_dense_proj(cands.dense) if self.cand_dense_proj is not None else 0.0
        return self.cand_norm(ids + dense)

    def score(self, user_tokens: torch.Tensor, cands: Candidates) -> torch.Tensor:
        """(N, 2) click/conversion logits of every candidate against its user's K tokens."""
        b, k, d = user_tokens.shape
        cand = self.candidate_tokens(cands, b)
        kv_offsets = torch.arange(b + 1, device=cand.device) * k
        kv = self.target.context_kv(user_tokens.reshape(b * k, d))
        read = self.target(cand, cands.offsets, kv, kv_offsets)
        return self.head_logits(read, cand)

    COMPILABLE = ("head_logits",)  # models.inference.compile.compile_dense; the blocks list their own

    def head_logits(self, read: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([read, cand, read * cand], -1))  # the product exposes matches

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, 2) logits and the auxiliary next-event loss (0 when disabled)."""
        states, user_emb = self.history_states(batch.history, batch.profile.user_id)
        user_tokens = self._summarize(states, batch.history.offsets, user_emb)
        logits = self.score(user_tokens, batch.candidates)
        aux = states.new_zeros(())
        if self.training and self.cfg.next_event_weight > 0 and self.cfg.pooling == "transformer":
            aux = self.next_event_loss(states, batch.history)
        return logits, aux

    def next_event_loss(self, states: torch.Tensor, history: Events) -> torch.Tensor:
        """Sampled softmax: the state at event i scores the ad of event i+1 against shared random ads."""
        total = states.shape[0]
        if total < 2:
            return states.new_zeros(())
        has_next = torch.ones(total, dtype=torch.bool, device=states.device)
        # the last event of each sequence has no successor (an empty sequence re-marks its predecessor's last)
        has_next[history.offsets[1:] - 1] = False
        src = has_next.nonzero().squeeze(1)
        if src.numel() == 0:
            return states.new_zeros(())
        table = self.sparse.table("ad_id")
        target = history.ad_id[src + 1].clamp(0, table.shape[0] - 1)
        negatives = torch.randint(0, table.shape[0] - 1, (self.cfg.num_negatives,), device=states.device)
        h = l2_normalize(self.next_proj(states[src]))
        return sampled_softmax_loss(
            h, l2_normalize(table[target]), l2_normalize(table[negatives]), target, negatives,
            self.cfg.next_item_temperature,
        )  # fmt: skip
