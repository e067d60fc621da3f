"""Building blocks shared by the user model and the ranker, all on jagged (total, d) tensors.

Attention goes only through ``models.attention.dispatch`` (the backend comes from the model config).
The feed-forward sits behind ``make_ffn`` so a mixture-of-experts block with the same (total, d) -> (total, d)
signature can replace it without touching the blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from models.architectures.transforms import lengths
from models.attention import dispatch


def segment_ids(offsets: torch.Tensor) -> torch.Tensor:
    """(total,) index of the sequence each row belongs to."""
    n = lengths(offsets)
    return torch.repeat_interleave(torch.arange(n.numel(), device=offsets.device), n)


def segment_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(total, d) -> (B, d) mean per sequence; an empty sequence gives zeros."""
    out = values.new_zeros(offsets.numel() - 1, values.shape[-1])
    out.index_add_(0, segment_ids(offsets), values)
    return out / lengths(offsets).clamp(min=1)[:, None].to(values.dtype)


def segment_cumulative_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(total, d) -> (total, d): row i is the mean of its sequence's rows up to and including i (causal)."""
    if values.shape[0] == 0:
        return values
    csum = torch.cumsum(values, 0)
    seg = segment_ids(offsets)
    before = torch.cat([values.new_zeros(1, values.shape[-1]), csum])[offsets[:-1]][
        seg
    ]  # sums of earlier seqs
    count = torch.arange(values.shape[0], device=values.device) - offsets[:-1][seg] + 1
    return (csum - before) / count[:, None].to(values.dtype)


def segment_softmax(scores: torch.Tensor, seg: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Softmax of (total,) scores within each segment."""
    top = scores.new_full((num_segments,), float("-inf")).scatter_reduce(0, seg, scores, "amax")
    e = torch.exp(scores - top[seg])
    denom = e.new_zeros(num_segments).index_add_(0, seg, e)
    return e / denom[seg]


def jagged_concat(
    a: torch.Tensor, a_offsets: torch.Tensor, b: torch.Tensor, b_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence [a_i ++ b_i] without padding: returns values and offsets."""
    la, lb = lengths(a_offsets), lengths(b_offsets)
    offsets = torch.zeros_like(a_offsets)
    offsets[1:] = torch.cumsum(la + lb, 0)
    pos_a = (
        torch.arange(a.shape[0], device=a.device)
        - a_offsets[segment_ids(a_offsets)]
        + offsets[:-1][segment_ids(a_offsets)]
    )
    seg_b = segment_ids(b_offsets)
    pos_b = torch.arange(b.shape[0], device=b.device) - b_offsets[seg_b] + offsets[:-1][seg_b] + la[seg_b]
    out = a.new_empty((a.shape[0] + b.shape[0], *a.shape[1:]))
    out[pos_a] = a
    out[pos_b] = b
    return out, offsets


class FeedForward(nn.Module):
    """The dense FFN; any module with this (total, d) -> (total, d) signature (e.g. MoE) can replace it."""

    def __init__(self, dim: int, mult: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, mult * dim), nn.GELU(), nn.Linear(mult * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_ffn(dim: int, mult: int, dropout: float) -> nn.Module:
    return FeedForward(dim, mult, dropout)


class MixtureOfExperts(nn.Module):
    """Top-k mixture of ``FeedForward`` experts in plain PyTorch: the inference form of the DeepSpeed MoE blocks
    that ``gemflow train --nproc`` trains (``models.training.distributed.moe``), loadable without DeepSpeed.

    Gating as DeepSpeed's top-1 / top-2 gates: fp32 logits ``x @ gate.weight.T`` (no bias), softmax over the
    experts; top-1 scales the chosen expert's output by its probability, top-2 by the two probabilities
    renormalized to sum 1 (the second expert is the runner-up, not sampled). Every token reaches its experts:
    no capacity limit, nothing dropped (DeepSpeed drops tokens over an expert's capacity only while training).
    """

    def __init__(self, dim: int, mult: int, dropout: float, num_experts: int, top_k: int = 1):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MixtureOfExperts: top_k={top_k} must be in 1..num_experts={num_experts}")
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(dim, mult, dropout) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(nn.functional.linear(x.float(), self.gate.weight.float()), dim=-1)
        weight, expert_of = probs.topk(self.top_k, dim=-1)  # (total, k)
        if self.top_k > 1:
            weight = weight / weight.sum(-1, keepdim=True).clamp(min=torch.finfo(weight.dtype).eps)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # routes summed in fp32
        for e, expert in enumerate(self.experts):
            token, route = (expert_of == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]).float() * weight[token, route, None])
        return out.to(x.dtype)


def use_moe_ffn(blocks: nn.ModuleList, kinds: list[str], num_experts: int, top_k: int) -> int:
    """Replace ``blocks[i].ffn`` by a ``MixtureOfExperts`` of the same width where ``kinds[i] == "moe"``."""
    swapped = 0
    for block, kind in zip(blocks, kinds, strict=True):
        if kind == "moe":
            first, drop = block.ffn.net[0], block.ffn.net[3]
            mult = first.out_features // first.in_features
            block.ffn = MixtureOfExperts(first.in_features, mult, drop.p, num_experts, top_k)
            swapped += 1
    return swapped


class JaggedSelfAttention(nn.Module):
    """Multi-head self-attention within each sequence, with learned relative position / time-gap biases."""

    def __init__(
        self, dim: int, heads: int, *, causal: bool, max_rel_pos: int, time_buckets: int, backend: str
    ):
        super().__init__()
        self.heads, self.causal, self.backend = heads, causal, backend
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.pos_bias = nn.Parameter(torch.zeros(heads, 2 * max_rel_pos + 1)) if max_rel_pos > 0 else None
        self.time_bias = nn.Parameter(torch.zeros(heads, time_buckets)) if time_buckets > 0 else None

    def forward(
        self, x: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor | None
    ) -> torch.Tensor:
        return self.out(self.attend(self.project(x), offsets, timestamps))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """(total, d) -> q, k, v packed as (total, 3, H, D) (a view of the fused projection, no copy): per-token
        work, compiled with the norm before it; the attention gathers each row's q, k, v together."""
        total, dim = x.shape
        return self.qkv(x).view(total, 3, self.heads, dim // self.heads)

    def attend(self, qkv, offsets: torch.Tensor, timestamps: torch.Tensor | None) -> torch.Tensor:
        """Attention within each sequence (eager: data-dependent buckets) -> (total, d) before ``out``."""
        total, _, heads, head_dim = qkv.shape
        y = dispatch.jagged_self_attention_packed(
            qkv,
            offsets,
            backend=self.backend,
            causal=self.causal,
            pos_bias=self.pos_bias,
            time_bias=self.time_bias if timestamps is not None else None,
            timestamps=timestamps,
        )
        return y.reshape(total, heads * head_dim)


class TransformerBlock(nn.Module):
    """Pre-norm: x + attn(norm(x)); x + ffn(norm(x)).

    Split at the attention call into two per-token halves (``project_qkv``, ``finish``) that
    ``models.inference.compile.compile_dense`` compiles (norm + projection, out projection + residual + norm + FFN + residual
    fused); the jagged attention between them stays eager.
    """

    COMPILABLE = ("project_qkv", "finish")

    def __init__(self, dim, heads, ffn_mult, dropout, *, causal, max_rel_pos, time_buckets, backend):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = JaggedSelfAttention(
            dim, heads, causal=causal, max_rel_pos=max_rel_pos, time_buckets=time_buckets, backend=backend
        )
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = make_ffn(dim, ffn_mult, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, offsets, timestamps=None):
        return self.finish(x, self.attn.attend(self.project_qkv(x), offsets, timestamps))

    def project_qkv(self, x):
        return self.attn.project(self.norm1(x))

    def finish(self, x, attended):
        x = x + self.drop(self.attn.out(attended))
        return x + self.ffn(self.norm2(x))


class CrossAttention(nn.Module):
    """Jagged queries over jagged keys/values. ``project_kv`` is split out so K/V can be computed once and
    reused by many queries (one user's context, thousands of candidates).

    Projections start near the identity: queries and keys live in the one shared token space, so at step 0
    a candidate already attends most to the events that share its ids (ad, advertiser, category) and reads
    them back unchanged; training refines that instead of first having to discover it.
    """

    def __init__(self, dim: int, heads: int, backend: str):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)
        with torch.no_grad():
            eye = torch.eye(dim)
            for linear, weight in ((self.q, eye), (self.kv, torch.cat([eye, eye])), (self.out, eye)):
                linear.weight.copy_(weight + 0.02 * torch.randn_like(weight))
                linear.bias.zero_()

    def project_kv(self, context: torch.Tensor) -> torch.Tensor:
        """(total, d) -> k, v packed as (total, 2, H, D) (a view of the fused projection)."""
        total, dim = context.shape
        return self.kv(context).view(total, 2, self.heads, dim // self.heads)

    def forward(self, queries, q_offsets, kv: torch.Tensor, kv_offsets) -> torch.Tensor:
        return self.out(self.attend(self.project_q(queries), q_offsets, kv, kv_offsets))

    def project_q(self, queries: torch.Tensor) -> torch.Tensor:
        total, dim = queries.shape
        return self.q(queries).view(total, self.heads, dim // self.heads)

    def attend(self, q, q_offsets, kv: torch.Tensor, kv_offsets) -> torch.Tensor:
        """Jagged cross-attention (eager) -> (total_q, d) before ``out``."""
        total, heads, head_dim = q.shape
        y = dispatch.jagged_cross_attention_packed(q, q_offsets, kv, kv_offsets, backend=self.backend)
        return y.reshape(total, heads * head_dim)


class TargetAwareBlock(nn.Module):
    """Each candidate (query) attends over its user's context tokens; pre-norm, residual, FFN.

    The context is normalized and projected to K/V once (``context_kv``); ``forward`` only touches queries.
    Its per-token halves (``context_kv``, ``project_query``, ``finish``) are what ``compile_dense`` compiles.
    """

    COMPILABLE = ("context_kv", "project_query", "finish")

    def __init__(self, dim: int, heads: int, ffn_mult: int, dropout: float, backend: str):
        super().__init__()
        self.norm_q = nn.LayerNorm(dim)
        self.norm_ctx = nn.LayerNorm(dim)
        self.attn = CrossAttention(dim, heads, backend)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = make_ffn(dim, ffn_mult, dropout)

    def context_kv(self, context: torch.Tensor) -> torch.Tensor:
        return self.attn.project_kv(self.norm_ctx(context))

    def forward(self, q, q_offsets, kv, kv_offsets):
        return self.finish(q, self.attn.attend(self.project_query(q), q_offsets, kv, kv_offsets))

    def project_query(self, q):
        return self.attn.project_q(self.norm_q(q))

    def finish(self, q, attended):
        q = q + self.attn.out(attended)
        return q + self.ffn(self.norm2(q))


class DinPooling(nn.Module):
    """DIN-style target attention (ablation): a small MLP scores (history token, candidate) pairs; the
    candidate's context is the softmax-weighted sum of its user's tokens. No query/key projections."""

    def __init__(self, dim: int, hidden: int = 64):
        super().__init__()
        self.score = nn.Sequential(nn.Linear(4 * dim, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, cand, q_offsets, context, kv_offsets):
        # pair every candidate with every token of its user's context (flat, no padding)
        cand_user = segment_ids(q_offsets)
        n_ctx = lengths(kv_offsets)[cand_user]
        pair_cand = torch.repeat_interleave(torch.arange(cand.shape[0], device=cand.device), n_ctx)
        start = kv_offsets[:-1][cand_user]
        pair_pos = torch.arange(int(n_ctx.sum()), device=cand.device)
        pair_pos = pair_pos - torch.repeat_interleave(torch.cumsum(n_ctx, 0) - n_ctx, n_ctx)
        h = context[torch.repeat_interleave(start, n_ctx) + pair_pos]
        c = cand[pair_cand]
        s = self.score(torch.cat([h, c, h * c, h - c], -1)).squeeze(-1)
        w = segment_softmax(s, pair_cand, cand.shape[0])
        out = cand.new_zeros(cand.shape)
        return out.index_add_(0, pair_cand, w[:, None] * h)


class FeatureInteraction(nn.Module):
    """A few self-attention layers over one candidate's F feature tokens, then flatten -> (N, F * dim)."""

    def __init__(self, dim, heads, ffn_mult, dropout, num_layers, backend):
        super().__init__()
        self.blocks = nn.ModuleList(
            TransformerBlock(
                dim, heads, ffn_mult, dropout, causal=False, max_rel_pos=0, time_buckets=0, backend=backend
            )
            for _ in range(num_layers)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n, f, d = tokens.shape
        x = tokens.reshape(n * f, d)
        offsets = torch.arange(n + 1, device=tokens.device) * f
        for block in self.blocks:
            x = block(x, offsets)
        return x.reshape(n, f * d)


def mlp_head(in_dim: int, hidden: int, out_dim: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        nn.LayerNorm(in_dim),
        nn.Linear(in_dim, hidden),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, out_dim),
    )
