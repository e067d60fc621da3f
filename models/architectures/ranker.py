"""The online ranker: each candidate ad is a query over [cached user tokens ++ recent fresh events].

    user side (once per request):  cached user tokens (B, K, d_user) -> projected   ┐
                                    recent events (<= 64) -> EventTokenizer          ├─ context, K/V per block
                                    profile (age, gender, country) -> tokens         ┘
    candidates (N per request):     ids + dense features -> tokens -> query
                                    L x TargetAwareBlock(query over the user's context K/V)
                                    [read query, read * candidate, candidate token, profile tokens]
                                    (optional FeatureInteraction over these few tokens) -> MLP -> logits

The candidate enters as ONE token (the sum of its id embeddings + a projection of its dense features), so the
per-candidate cost is the L small query-side blocks plus the head, ~0.1-0.2 MFLOP at the default config
(``bench/serve.py``, ``docs/model-results.md``): serving 1,000 candidates stays cheap on CPU.

``user_side`` computes everything that does not depend on the candidate, including every block's K/V, so
scoring thousands of candidates reuses it (``score``).

Serving fast path (same parameters, same outputs): with gradients off, ids are gathered straight from the
EmbeddingCollection's tables (``F.embedding`` on the same weights and the same OOV rule, no KeyedJaggedTensor per
call), and one user goes through ``models.inference.one_user`` (scripted by TorchScript in the server): its user side in one
call, and its candidates attend to the user's context as one dense block (no jagged planning, no row moves), the
per-candidate GEMMs run on oneDNN with their bias, GELU and residual add fused (``models.inference.onednn``; or on PyTorch's
own where that measured faster, ``models.inference.one_user.script``), and the head is expanded over the shared profile.
Training (gradients on) keeps the torchrec path its fused sparse optimizer needs.

Ablations (config flags): ``pooling="mean"`` (mean of the context, no attention), ``pooling="din"`` (DIN-style
MLP-scored target attention), and ``use_user_tokens=False`` (online-only: no cached user tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.architectures.layers import (
    DinPooling,
    FeatureInteraction,
    TargetAwareBlock,
    jagged_concat,
    mlp_head,
    segment_ids,
    segment_mean,
)
from models.architectures.tokenizer import (
    GAP_TABLE,
    DenseTokens,
    EventTokenizer,
    SparseArch,
    event_features,
    event_ids,
    gather_rows,
)
from models.architectures.transforms import lengths
from models.config import RankerConfig
from models.inference import one_user, onednn
from models.inference.one_user import OneUserScorer
from models.training.batch import CANDIDATE_ID_FIELDS, EVENT_ID_FIELDS, Batch, Candidates, Events, Profile

PROFILE_TOKENS = 3  # age, gender, country


@dataclass
class CandidateQueries:
    """What scoring computes of each candidate before it meets the user (``Ranker.candidate_queries``)."""

    token: torch.Tensor  # (N, d) the candidate's one token
    first_query: torch.Tensor | None  # (N, d) the first target-aware block's projected query, or None

    def rows(self, index: torch.Tensor) -> CandidateQueries:
        first = None if self.first_query is None else self.first_query.index_select(0, index)
        return CandidateQueries(self.token.index_select(0, index), first)

    def part(self, start: int, stop: int) -> CandidateQueries:
        first = None if self.first_query is None else self.first_query[start:stop]
        return CandidateQueries(self.token[start:stop], first)


@dataclass
class UserSide:
    """Everything about the user that all candidates share (computed once per request)."""

    context: torch.Tensor  # (total, d) [user tokens ++ recent events] per user, jagged
    offsets: torch.Tensor  # (B + 1,)
    kv: list[torch.Tensor]  # per target-aware block: K, V of the context packed as (total, 2, H, D)
    profile: torch.Tensor  # (B, PROFILE_TOKENS, d)


class Ranker(nn.Module):
    def __init__(
        self,
        cfg: RankerConfig,
        vocab: dict[str, int],
        num_dense: int,
        user_token_dim: int = 0,
        torchrec: bool = True,
    ):
        """``torchrec=False``: the embedding tables without torchrec (a model loaded to be read: ``SparseArch``)."""
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        features = {
            **event_features("recent"),
            **{f"cand_{f}": f for f in CANDIDATE_ID_FIELDS},
            "gender": "gender",
            "country": "country",
        }
        self.sparse = SparseArch(features, {**vocab, GAP_TABLE: cfg.time_buckets}, d, torchrec)
        self.events = EventTokenizer(d)
        self.user_proj = nn.Linear(user_token_dim, d) if cfg.use_user_tokens and user_token_dim else None
        self.age = DenseTokens(1, d)
        # the query is built like an event token (sum of its id embeddings) so it lives in the same space
        self.query_dense = nn.Linear(num_dense, d)
        self.query_norm = nn.LayerNorm(d)
        blocks = cfg.num_layers if cfg.pooling == "target" else 0
        self.blocks = nn.ModuleList(
            TargetAwareBlock(d, cfg.num_heads, cfg.ffn_mult, cfg.dropout, cfg.attention_backend)
            for _ in range(blocks)
        )
        self.din = DinPooling(d) if cfg.pooling == "din" else None
        self.interaction = FeatureInteraction(
            d, cfg.num_heads, cfg.ffn_mult, cfg.dropout, cfg.interaction_layers, cfg.attention_backend
        )
        self.head = mlp_head((3 + PROFILE_TOKENS) * d, cfg.head_hidden or d, 2, cfg.dropout)

    def user_side(
        self,
        recent: Events,
        profile: Profile,
        user_tokens: torch.Tensor | None = None,
        user_token_mask: torch.Tensor | None = None,
    ) -> UserSide:
        b = recent.batch_size
        if b == 1 and self._gather_directly() and (scorer := self.one_user_scorer()) is not None:
            return self._one_user_side(scorer, recent, profile, user_tokens, user_token_mask)
        ones = torch.ones(b, dtype=torch.int64, device=recent.offsets.device)
        if self._gather_directly():
            emb = {f"recent_{f}": self._embed(f, getattr(recent, f)) for f in EVENT_ID_FIELDS}
            emb[f"recent_{GAP_TABLE}"] = self._embed(GAP_TABLE, recent.gap_bucket)
            emb["gender"] = self._embed("gender", profile.gender)
            emb["country"] = self._embed("country", profile.country)
        else:
            emb = self.sparse(
                {
                    **event_ids("recent", recent),
                    "gender": (profile.gender, ones),
                    "country": (profile.country, ones),
                },
                b,
            )
        context, offsets = self.events(emb, "recent"), recent.offsets
        if self.user_proj is not None and user_tokens is not None:
            k = user_tokens.shape[1]
            present = user_token_mask if user_token_mask is not None else torch.ones(b, dtype=torch.bool)
            present = present.to(offsets.device)
            user_offsets = torch.zeros_like(offsets)
            user_offsets[1:] = torch.cumsum(present.long() * k, 0)
            tokens = self.user_proj(user_tokens[present].reshape(-1, user_tokens.shape[-1]))
            context, offsets = jagged_concat(tokens, user_offsets, context, offsets)
        prof = torch.stack([emb["gender"], emb["country"]], 1)
        prof = torch.cat([self.age(profile.dense[:, :1]), prof], 1)
        kv = [block.context_kv(context) for block in self.blocks]
        return UserSide(context, offsets, kv, prof)

    @staticmethod
    def _one_user_side(scorer, recent: Events, profile: Profile, user_tokens, user_token_mask) -> UserSide:
        """``user_side`` of one user at inference, as one call of the one-user path (``models.inference.one_user``)."""
        if user_token_mask is not None and not bool(user_token_mask[0]):
            user_tokens = None
        events = [getattr(recent, f) for f in EVENT_ID_FIELDS] + [recent.gap_bucket]
        context, kv, prof = scorer.user_side(
            events, [profile.gender, profile.country], profile.dense[:, :1], user_tokens
        )
        return UserSide(context, torch.tensor([0, context.shape[0]]), kv, prof)

    def candidate_queries(self, cands: Candidates, project: bool = False) -> CandidateQueries:
        """The user-independent part of the candidates' queries: each candidate's token (the sum of its id
        embeddings and its projected dense features, normalized) and, with ``project``, the first target-aware
        block's projected query of it."""
        if self._gather_directly():
            ids = sum(self._embed(f, getattr(cands, f)) for f in CANDIDATE_ID_FIELDS)
        else:
            per_user = lengths(cands.offsets)
            b = cands.offsets.numel() - 1
            emb = self.sparse({f"cand_{f}": (getattr(cands, f), per_user) for f in CANDIDATE_ID_FIELDS}, b)
            ids = sum(emb[f"cand_{f}"] for f in CANDIDATE_ID_FIELDS)
        token = self.query_norm(ids + self.query_dense(cands.dense))
        first = None
        if project and self.cfg.pooling == "target" and len(self.blocks):
            block = self.blocks[0]
            first = onednn.linear(block.norm_q(token), block.attn.q.weight, block.attn.q.bias)
        return CandidateQueries(token, first)

    def score(
        self, side: UserSide, cands: Candidates | None, queries: CandidateQueries | None = None
    ) -> torch.Tensor:
        """(N, 2) logits; ``cands.offsets`` groups the N candidates by the users of ``side``. ``queries``: the
        candidates' ``candidate_queries`` when the caller has them already (serving caches them per ad); with them
        and one user, ``cands`` may be None."""
        b = side.offsets.numel() - 1
        one_user_path = b == 1 and not torch.is_grad_enabled()
        if queries is None:
            queries = self.candidate_queries(cands, project=one_user_path)
        elif cands is None and b != 1:
            raise ValueError("Ranker.score needs the candidates' offsets to score more than one user")
        if one_user_path and (scorer := self.one_user_scorer()) is not None:
            return one_user.score(
                scorer, queries.token, queries.first_query, side.kv, side.profile.reshape(-1)
            )
        offsets = torch.tensor([0, queries.token.shape[0]]) if cands is None else cands.offsets
        q0 = q = queries.token  # the candidate's one token
        if self.cfg.pooling == "target":
            for block, kv in zip(self.blocks, side.kv, strict=True):
                q = block(q, offsets, kv, side.offsets)
        elif self.cfg.pooling == "mean":
            q = q + segment_mean(side.context, side.offsets)[segment_ids(offsets)]
        else:
            q = q + self.din(q, offsets, side.context, side.offsets)
        # q * q0 exposes how well what the candidate read from the context matches the candidate itself
        tokens = torch.cat([torch.stack([q, q * q0, q0], 1), side.profile[segment_ids(offsets)]], 1)
        return self.head(self.interaction(tokens))

    def one_user_scorer(self) -> OneUserScorer | None:
        """The one-user inference path over this ranker's own layers (``models.inference.one_user``), or None where it does
        not apply (training mode, another pooling, mixture-of-experts blocks, interaction layers). Kept outside
        the module tree: its layers are this ranker's, so it adds nothing to ``state_dict``."""
        if self.training:
            return None
        if "_one_user" not in self.__dict__:
            self.__dict__["_one_user"] = OneUserScorer(self) if OneUserScorer.supports(self) else None
        return self.__dict__["_one_user"]

    def script_one_user(self, variant: str | None = None) -> bool:
        """Run the one-user inference path compiled by TorchScript from now on (serving: one GIL release per
        scoring call, ``models.inference.one_user``), the fastest variant on this CPU or ``variant``; False where it does not
        apply."""
        scripted = one_user.script(self, variant=variant)
        if scripted is not None:
            self.__dict__["_one_user"] = scripted
        return scripted is not None

    # ------------------------------------------------------------------------------- serving fast path
    def _gather_directly(self) -> bool:
        """Inference on the plain (unsharded) EmbeddingCollection: gather rows without a KeyedJaggedTensor."""
        return not torch.is_grad_enabled() and isinstance(self.sparse, SparseArch)

    def _embed(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``SparseArch`` returns for ``ids`` of ``table`` (ids outside the vocabulary -> the OOV row)."""
        return gather_rows(ids.long(), self.sparse.table(table), self.sparse.sizes[table])

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        side = self.user_side(batch.history, batch.profile, batch.user_tokens, batch.user_token_mask)
        logits = self.score(side, batch.candidates)
        return logits, logits.new_zeros(())
