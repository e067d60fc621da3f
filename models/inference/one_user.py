"""``Ranker.user_side`` and ``Ranker.score`` for ONE user at inference: the serving path, scriptable with TorchScript.

With one user the jagged layout is a single dense block: every candidate attends over the same context
(``models.attention.shared_context``: gemflow's fused C++ op where it is built), the linear layers run on oneDNN
with their bias, GELU and residual fused (``models.inference.onednn``) or on PyTorch's own GEMMs, or the whole candidate path
is one C++ op (``FusedOneUserScorer``), whichever ``script`` measured fastest on this CPU; the head's LayerNorm +
Linear over [candidate ++ profile] is expanded so that the profile's share is computed once (``OneUserHead``). ``OneUserScorer.user_side`` is the user's half: its ids
gathered straight from the embedding tables, [user tokens ++ events] as one context, every block's K/V. The
modules here hold the ranker's own layers and tables (no copies): they follow its weights.

Why TorchScript: a 1,000-candidate request is ~100 small torch ops, and every op releases and re-takes the GIL. A
server scores on two threads next to its event loop and store-read threads, so nearly every re-take waits on a
futex and switches context (under two clients, 14% of the server's CPU was the kernel's task switch: perf,
docs/serving-speed.md). ``script(ranker)`` runs the user side and the candidate path as one call each, with the
GIL released once per call (the user side alone was ~60 ops: scripting it took 12% off the server's CPU per
request and 28% of its context switches). The eager modules are the same code (``Ranker.user_side`` and
``Ranker.score`` call them); tests compare the two and the training path.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from models.architectures.layers import FeedForward
from models.architectures.tokenizer import GAP_TABLE, SparseArch, gather_rows
from models.attention.shared_context import FusedAttention, attention_module, context_layout
from models.inference import onednn
from models.inference.row_buckets import bucket_rows
from models.training.batch import EVENT_ID_FIELDS

log = logging.getLogger(__name__)


class OneUserBlock(nn.Module):
    """``TargetAwareBlock.forward`` for the candidates of one user, given the context's K/V layout."""

    def __init__(self, block, use_onednn: bool, attention: nn.Module):
        super().__init__()
        up, _, down, _ = block.ffn.net  # Linear, GELU, Linear, Dropout (identity in eval)
        self.norm_q, self.q, self.out = block.norm_q, block.attn.q, block.attn.out
        self.norm2, self.up, self.down = block.norm2, up, down
        self.use_onednn, self.attention = use_onednn, attention

    def forward(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, projected: torch.Tensor | None
    ) -> torch.Tensor:
        """``projected``: the block's projected queries when the caller has them (serving caches block 0's)."""
        dnn = self.use_onednn
        if projected is None:
            projected = onednn.linear(self.norm_q(q), self.q.weight, self.q.bias, "none", None, dnn)
        q = onednn.linear(
            self.attention(projected, keys, values), self.out.weight, self.out.bias, "none", q, dnn
        )
        h = onednn.linear(self.norm2(q), self.up.weight, self.up.bias, "gelu", None, dnn)
        return onednn.linear(h, self.down.weight, self.down.bias, "none", q, dnn)


class ContextKV(nn.Module):
    """``TargetAwareBlock.context_kv``: the context's K/V packed as (T, 2, H, d/H)."""

    def __init__(self, block):
        super().__init__()
        self.norm, self.kv, self.heads = block.norm_ctx, block.attn.kv, block.attn.heads

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        n, width = context.shape[0], context.shape[1]
        return self.kv(self.norm(context)).view(n, 2, self.heads, width // self.heads)


class OneUserHead(nn.Module):
    """The ranker's head (LayerNorm, Linear, GELU, Linear) on rows [cand_i ++ profile], the profile the same for
    every candidate, without building the profile part N times: LayerNorm then Linear, expanded over the parts.

        LN(x) W^T + c = rstd * ((x * g) W^T - mean * (g W^T)) + (b W^T + c),   x = [cand_i ++ profile]

    The row mean / variance combine each part's own (Chan's formula, no cancellation); the profile's share of the
    matmul, ``(profile * g_p) W_p^T``, is one vector per request.
    """

    def __init__(self, head: nn.Sequential, use_onednn: bool = True):
        super().__init__()
        self.norm, self.first, self.last = head[0], head[1], head[4]
        self.use_onednn = use_onednn

    def forward(self, cand: torch.Tensor, profile: torch.Tensor) -> torch.Tensor:
        k = cand.shape[1]
        g, b, w = self.norm.weight, self.norm.bias, self.first.weight
        # (torch.var_mean over rows is ~20x slower than these three passes on CPU)
        mean_c = cand.mean(-1)
        var_c = (cand - mean_c[:, None]).square().mean(-1)
        mean_p = profile.mean()
        var_p = (profile - mean_p).square().mean()
        n_c, n_p = float(k), float(profile.numel())
        mean = (n_c * mean_c + n_p * mean_p) / (n_c + n_p)
        var = (n_c * (var_c + (mean_c - mean) ** 2) + n_p * (var_p + (mean_p - mean) ** 2)) / (n_c + n_p)
        rstd = torch.rsqrt(var + self.norm.eps)
        from_profile = (profile * g[k:]) @ w[:, k:].T  # (hidden,)
        z = onednn.linear(cand, w[:, :k] * g[:k], from_profile, "none", None, self.use_onednn)  # (N, hidden)
        z = torch.addcmul(z, mean[:, None], (w @ g)[None], value=-1.0)
        z = torch.addcmul(self.first.bias + w @ b, z, rstd[:, None])
        return self.last(F.gelu(z))


class OneUserScorer(nn.Module):
    """(N, 2) logits of one user's N candidates from their tokens and the user's per-block K/V; and
    ``user_side``, that K/V (and the profile) from the user's ids."""

    def __init__(self, ranker, use_onednn: bool = True, attention: nn.Module | None = None):
        """``attention``: the candidates' attention over the context (default ``attention_module()``: the fused
        C++ op where it is built)."""
        super().__init__()
        attention = attention_module() if attention is None else attention
        self.blocks = nn.ModuleList([OneUserBlock(block, use_onednn, attention) for block in ranker.blocks])
        self.head = OneUserHead(ranker.head, use_onednn)
        fields = [*EVENT_ID_FIELDS, GAP_TABLE]
        self.event_tables = [ranker.sparse.table(f) for f in fields]
        self.event_sizes = [ranker.sparse.sizes[f] for f in fields]
        self.profile_tables = [ranker.sparse.table(f) for f in ("gender", "country")]
        self.profile_sizes = [ranker.sparse.sizes[f] for f in ("gender", "country")]
        self.event_norm, self.user_proj, self.age = ranker.events.norm, ranker.user_proj, ranker.age
        self.context_kv = nn.ModuleList([ContextKV(block) for block in ranker.blocks])

    @torch.jit.export
    def user_side(
        self, events: list[torch.Tensor], profile_ids: list[torch.Tensor], age: torch.Tensor,
        user_tokens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:  # fmt: skip
        """``Ranker.user_side`` for one user: ``events`` the (T,) ids of ``EVENT_ID_FIELDS`` + the gap bucket,
        ``profile_ids`` gender and country (1,), ``age`` (1, 1), ``user_tokens`` (1, K, w) or None. Returns the
        context [user tokens ++ events] (C, d), every block's K/V (C, 2, H, d/H) and the profile (1, 3, d)."""
        context = gather_rows(events[0], self.event_tables[0], self.event_sizes[0])
        for i in range(1, len(events)):
            context = context + gather_rows(events[i], self.event_tables[i], self.event_sizes[i])
        context = self.event_norm(context)
        proj = self.user_proj
        if proj is not None and user_tokens is not None:
            context = torch.cat([proj(user_tokens.reshape(-1, user_tokens.shape[-1])), context], 0)
        return context, [block(context) for block in self.context_kv], self.profile(profile_ids, age)

    def profile(self, profile_ids: list[torch.Tensor], age: torch.Tensor) -> torch.Tensor:
        """The (1, 3, d) profile tokens: age, gender, country."""
        gender = gather_rows(profile_ids[0], self.profile_tables[0], self.profile_sizes[0])
        country = gather_rows(profile_ids[1], self.profile_tables[1], self.profile_sizes[1])
        return torch.cat([self.age(age), torch.stack([gender, country], 1)], 1)

    @staticmethod
    def supports(ranker) -> bool:
        """Whether ``ranker``'s one-user scoring is what these modules compute (target-aware pooling, feed-forward
        blocks, no feature-interaction layers, the standard head, unsharded tables) in inference mode."""
        head = list(ranker.head)
        return (
            not ranker.training
            and isinstance(ranker.sparse, SparseArch)  # its own tables, not sharded ones
            and ranker.cfg.pooling == "target"
            and not ranker.interaction.blocks
            and all(isinstance(block.ffn, FeedForward) for block in ranker.blocks)
            and [type(m) for m in head] == [nn.LayerNorm, nn.Linear, nn.GELU, nn.Dropout, nn.Linear]
            and head[2].approximate == "none"
        )

    def forward(
        self,
        token: torch.Tensor,
        first_query: torch.Tensor | None,
        kv: list[torch.Tensor],
        profile: torch.Tensor,
    ) -> torch.Tensor:
        """``token`` (N, d): the candidates' tokens; ``first_query``: block 0's projected queries if known;
        ``kv``: per block, the context's K/V packed (T, 2, H, d/H); ``profile`` (P * d,): the user's profile."""
        q = token
        for i, block in enumerate(self.blocks):
            keys, values = context_layout(kv[i])
            q = block(q, keys, values, first_query if i == 0 else None)
        # q * q0 exposes how well what the candidate read from the context matches the candidate itself
        return self.head(torch.cat([q, q * token, token], 1), profile)


class FusedOneUserScorer(OneUserScorer):
    """``OneUserScorer`` whose candidate path is ONE call of gemflow's C++ op ``one_user_score`` and whose user side
    is one call of ``one_user_side`` (``models/inference/native/one_user.cpp``: ATen's GEMMs and GELU, gemflow's attention,
    the gathers, LayerNorms, residual adds and the head's expansion fused around them), the profile tokens as the
    parent makes them. Construct it only after ``models.inference.native.load()`` returned True, where ``applies(ranker)``."""

    def __init__(self, ranker):
        super().__init__(ranker, use_onednn=False, attention=FusedAttention())
        weights: list[torch.Tensor] = []
        eps: list[float] = []
        for norm_q, q, out, norm2, up, down in _block_layers(ranker):
            for m in (norm_q, q, out, norm2, up, down):
                weights += [m.weight, m.bias]
            eps += [norm_q.eps, norm2.eps]
        for m in (ranker.head[0], ranker.head[1], ranker.head[4]):
            weights += [m.weight, m.bias]
        eps.append(ranker.head[0].eps)
        self.weights = [w.detach() for w in weights]  # the ranker's own storage: they follow its weights
        self.eps = eps
        # the user side's operands (detached views, as above)
        self.side_tables = [t.detach() for t in self.event_tables]
        self.side_norm = [self.event_norm.weight.detach(), self.event_norm.bias.detach()]
        self.side_norm_eps = float(self.event_norm.eps)
        proj = ranker.user_proj
        self.has_proj = proj is not None
        self.proj_weights = (
            [torch.empty(0), torch.empty(0)] if proj is None else [proj.weight.detach(), proj.bias.detach()]
        )
        self.kv_weights = [
            w.detach()
            for block in self.context_kv
            for w in (block.norm.weight, block.norm.bias, block.kv.weight, block.kv.bias)
        ]
        self.kv_eps = [float(block.norm.eps) for block in self.context_kv]
        self.heads = ranker.blocks[0].attn.heads if len(ranker.blocks) else 1

    @staticmethod
    def applies(ranker) -> bool:
        """``OneUserScorer.supports`` and every layer with its bias (the op takes them all)."""
        if not OneUserScorer.supports(ranker):
            return False
        layers = [m for block in _block_layers(ranker) for m in block]
        layers += [ranker.head[0], ranker.head[1], ranker.head[4], ranker.events.norm]
        layers += [m for block in ranker.blocks for m in (block.norm_ctx, block.attn.kv)]
        if ranker.user_proj is not None:
            layers.append(ranker.user_proj)
        return all(m.weight is not None and m.bias is not None for m in layers)

    @torch.jit.export
    def user_side(
        self, events: list[torch.Tensor], profile_ids: list[torch.Tensor], age: torch.Tensor,
        user_tokens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:  # fmt: skip
        """``OneUserScorer.user_side`` with the context and K/V from one call of ``one_user_side``."""
        tokens: torch.Tensor | None = None
        proj_w: torch.Tensor | None = None
        proj_b: torch.Tensor | None = None
        if user_tokens is not None and self.has_proj:
            tokens = user_tokens.reshape(-1, user_tokens.shape[-1])
            proj_w, proj_b = self.proj_weights[0], self.proj_weights[1]
        context, kv = torch.ops.gemflow.one_user_side(
            events, self.side_tables, self.event_sizes, self.side_norm[0], self.side_norm[1], self.side_norm_eps,
            tokens, proj_w, proj_b, self.kv_weights, self.kv_eps, self.heads,
        )  # fmt: skip
        return context, kv, self.profile(profile_ids, age)

    def forward(
        self,
        token: torch.Tensor,
        first_query: torch.Tensor | None,
        kv: list[torch.Tensor],
        profile: torch.Tensor,
    ) -> torch.Tensor:
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for block_kv in kv:
            k, v = context_layout(block_kv)
            keys.append(k)
            values.append(v)
        return torch.ops.gemflow.one_user_score(
            token, first_query, keys, values, profile, self.weights, self.eps
        )


def _block_layers(ranker) -> list[tuple]:
    """Per target-aware block: (norm_q, q, out, norm2, up, down), the layers ``one_user_score`` takes."""
    layers = []
    for block in ranker.blocks:
        up, _, down, _ = block.ffn.net
        layers.append((block.norm_q, block.attn.q, block.attn.out, block.norm2, up, down))
    return layers


def score(scorer, token: torch.Tensor, first_query: torch.Tensor | None, kv, profile) -> torch.Tensor:
    """``scorer(token, first_query, kv, profile)``, the rows padded (``score_padded``) where the scorer runs
    oneDNN's GEMMs: MKL's (the other variants) cost the same on any row count (the one-op scorer, 400 requests of
    800-1,200 candidates: 2.07 ms median exact, 2.07 padded), so their rows are not copied to be padded."""
    if variant_of(scorer) == ONEDNN:
        return score_padded(scorer, token, first_query, kv, profile)
    return scorer(token, first_query, kv, profile)


def score_padded(scorer, token: torch.Tensor, first_query: torch.Tensor | None, kv, profile) -> torch.Tensor:
    """``scorer(token, first_query, kv, profile)`` on the candidates' rows padded with zeros to ``bucket_rows(N)``:
    the first N rows of its logits. oneDNN compiles a kernel per GEMM shape and keeps 1,024: requests of varied
    candidate counts met new shapes on most calls (an AMX Xeon, 400 requests of 800-1,200 candidates, the scripted
    scorer on oneDNN's GEMMs: 6.7 ms median per request on exact counts, 3.3 padded). Padded, a few sizes per power
    of two serve them all (at most 1/32 more rows). A zero row stays finite through every layer and is dropped."""
    n = token.shape[0]
    pad = bucket_rows(n) - n
    if pad:
        token = F.pad(token, (0, 0, 0, pad))
        first_query = None if first_query is None else F.pad(first_query, (0, 0, 0, pad))
    return scorer(token, first_query, kv, profile)[:n]


PYTORCH, ONEDNN, ONE_OP = "PyTorch's GEMMs", "oneDNN's GEMMs", "gemflow's one-op scorer"  # the variants


def script(ranker, rows: int = 1000, variant: str | None = None) -> torch.jit.ScriptModule | None:
    """The one-user scorer of ``ranker`` compiled by TorchScript, or None where it does not apply
    (``OneUserScorer.supports``).

    The variants: PyTorch's GEMMs, oneDNN's with fused post-ops (``models.inference.onednn``: oneDNN ran 2x MKL on a Zen 5,
    MKL 1-7% faster on a Zen 3) and, where gemflow's C++ kernels are built, the one-op scorer
    (``FusedOneUserScorer``). ``variant`` names the one to use (a server's worker processes take the one their
    server chose: the same answers, to the bit, whichever process scores); otherwise each available one is compiled
    (~0.2 s each) and timed on ``rows`` candidates of random values, the variants' calls alternating (as a server's
    scoring alternates with its other work: a loop of one variant alone runs in caches it never has in serving),
    and the fastest is kept (logged)."""
    if not OneUserScorer.supports(ranker):
        return None
    variants = {PYTORCH: OneUserScorer(ranker, False)}
    if onednn.AVAILABLE:
        variants[ONEDNN] = OneUserScorer(ranker, True)
    fused_attention = isinstance(variants[PYTORCH].blocks[0].attention, FusedAttention)
    if fused_attention and FusedOneUserScorer.applies(ranker):  # the C++ kernels are built
        variants[ONE_OP] = FusedOneUserScorer(ranker)
    if variant is not None:
        if variant not in variants:
            raise ValueError(
                f"one-user scorer variant {variant!r} is not available here (available: {sorted(variants)})"
            )
        return torch.jit.script(variants[variant].eval())
    scripted = {name: torch.jit.script(module.eval()) for name, module in variants.items()}
    if len(scripted) == 1:
        return scripted[PYTORCH]
    ms = _time_variants(scripted, _probe_inputs(ranker, rows))
    best = min(ms, key=ms.get)
    log.info("one-user scorer (attention: %s), %d candidates: %s; using %s",
             "gemflow's fused op" if fused_attention else "PyTorch's ops", rows,
             ", ".join(f"{name} {t:.2f} ms" for name, t in ms.items()), best)  # fmt: skip
    return scripted[best]


def variant_of(scorer) -> str:
    """Which of ``script``'s variants ``scorer`` (scripted or not) is."""
    name = getattr(scorer, "original_name", type(scorer).__name__)
    if name == "FusedOneUserScorer":
        return ONE_OP
    return ONEDNN if scorer.head.use_onednn else PYTORCH


def _probe_inputs(ranker, rows: int) -> tuple:
    """Arguments of ``OneUserScorer.forward`` shaped like a request of ``rows`` candidates (random values)."""
    cfg, g = ranker.cfg, torch.Generator().manual_seed(0)
    d, heads = cfg.d_model, cfg.num_heads
    context = cfg.recent_events + (cfg.num_user_tokens if ranker.user_proj is not None else 0)
    kv = [torch.randn(context, 2, heads, d // heads, generator=g) for _ in ranker.blocks]
    profile = torch.randn(ranker.head[1].in_features - 3 * d, generator=g)
    return torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g), kv, profile


@torch.inference_mode()
def _time_variants(variants: dict, inputs: tuple, warm: int = 3, rounds: int = 7) -> dict:
    """Best wall ms of each variant over ``rounds`` alternating calls, after ``warm`` calls each (TorchScript's
    profiling runs)."""
    for module in variants.values():
        for _ in range(warm):
            module(*inputs)
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for key, module in variants.items():
            t0 = time.perf_counter()
            module(*inputs)
            best[key] = min(best[key], 1e3 * (time.perf_counter() - t0))
    return best
