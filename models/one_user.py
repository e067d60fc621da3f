"""``Ranker.score`` for the candidates of ONE user at inference: the serving path, scriptable with TorchScript.

With one user the jagged layout is a single dense block: every candidate attends over the same context
(``models.attention.shared_context``), the linear layers run on oneDNN with their bias, GELU and residual fused
(``models.onednn``), and the head's LayerNorm + Linear over [candidate ++ profile] is expanded so that the profile's
share is computed once (``OneUserHead``). The modules here hold the ranker's own layers (no copies): they follow its
weights.

Why TorchScript: a 1,000-candidate request is ~100 small torch ops, and every op releases and re-takes the GIL. A
server scores on two threads next to its event loop and store-read threads, so nearly every re-take waits on a
futex and switches context (under two clients, 14% of the server's CPU was the kernel's task switch: perf,
docs/serving-speed.md). ``script(ranker)`` runs the whole candidate path as one call with the GIL released once.
The eager modules are the same code (``Ranker.score`` calls them); tests compare the two and the training path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import onednn
from models.attention.shared_context import attend, context_layout
from models.layers import FeedForward


class OneUserBlock(nn.Module):
    """``TargetAwareBlock.forward`` for the candidates of one user, given the context's K/V layout."""

    def __init__(self, block):
        super().__init__()
        up, _, down, _ = block.ffn.net  # Linear, GELU, Linear, Dropout (identity in eval)
        self.norm_q, self.q, self.out = block.norm_q, block.attn.q, block.attn.out
        self.norm2, self.up, self.down = block.norm2, up, down

    def forward(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, projected: torch.Tensor | None
    ) -> torch.Tensor:
        """``projected``: the block's projected queries when the caller has them (serving caches block 0's)."""
        if projected is None:
            projected = onednn.linear(self.norm_q(q), self.q.weight, self.q.bias)
        q = onednn.linear(attend(projected, keys, values), self.out.weight, self.out.bias, "none", q)
        h = onednn.linear(self.norm2(q), self.up.weight, self.up.bias, "gelu")
        return onednn.linear(h, self.down.weight, self.down.bias, "none", q)


class OneUserHead(nn.Module):
    """The ranker's head (LayerNorm, Linear, GELU, Linear) on rows [cand_i ++ profile], the profile the same for
    every candidate, without building the profile part N times: LayerNorm then Linear, expanded over the parts.

        LN(x) W^T + c = rstd * ((x * g) W^T - mean * (g W^T)) + (b W^T + c),   x = [cand_i ++ profile]

    The row mean / variance combine each part's own (Chan's formula, no cancellation); the profile's share of the
    matmul, ``(profile * g_p) W_p^T``, is one vector per request.
    """

    def __init__(self, head: nn.Sequential):
        super().__init__()
        self.norm, self.first, self.last = head[0], head[1], head[4]

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
        z = onednn.linear(cand, w[:, :k] * g[:k], from_profile)  # (N, hidden)
        z = torch.addcmul(z, mean[:, None], (w @ g)[None], value=-1.0)
        z = torch.addcmul(self.first.bias + w @ b, z, rstd[:, None])
        return self.last(F.gelu(z))


class OneUserScorer(nn.Module):
    """(N, 2) logits of one user's N candidates from their tokens and the user's per-block K/V."""

    def __init__(self, ranker):
        super().__init__()
        self.blocks = nn.ModuleList([OneUserBlock(block) for block in ranker.blocks])
        self.head = OneUserHead(ranker.head)

    @staticmethod
    def supports(ranker) -> bool:
        """Whether ``ranker``'s one-user scoring is what these modules compute (target-aware pooling, feed-forward
        blocks, no feature-interaction layers, the standard head) in inference mode."""
        head = list(ranker.head)
        return (
            not ranker.training
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


def script(ranker) -> torch.jit.ScriptModule | None:
    """``OneUserScorer(ranker)`` compiled by TorchScript (~1 s), or None where it does not apply (see
    ``OneUserScorer.supports``; oneDNN missing)."""
    if not (onednn.AVAILABLE and OneUserScorer.supports(ranker)):
        return None
    return torch.jit.script(OneUserScorer(ranker).eval())
