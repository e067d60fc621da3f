"""SASRec (Kang & McAuley, ICDM 2018), the baseline every sequential recommender is measured against.

Faithful to the paper: item embeddings shared by input and output, learned absolute positions over the last
``max_len`` items (left-padded), ``num_blocks`` causal self-attention blocks whose residual adds to the
*normalized* query (the paper's ``Q = LN(x)``, ``x = Q + MHA(Q, x, x)``), a point-wise two-layer FFN (ReLU),
dropout on embeddings, attention and FFN (``FastDropout`` on embeddings and FFN: a quarter of a CPU step was
``nn.Dropout``'s random numbers), and a final layer norm; the score of item i after position t is
``<F_t, M_i>``. The loss is the trainer's (``next_item.loss``): ``bce`` is the paper's (one sampled negative
per position), ``full`` the softmax cross-entropy that later work found far stronger for the same network.

It reads the same jagged ``Events`` as the user model (only ``ad_id``; no time, action or attributes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.architectures.fast_dropout import FastDropout
from models.config import SASRecConfig
from models.training.batch import Events


class SASRecAttention(nn.Module):
    """``nn.MultiheadAttention(d, heads, dropout, batch_first=True)`` with the same parameters (and state dict
    keys), taking one additive (B, 1, T, T) mask shared by the heads straight to
    ``F.scaled_dot_product_attention`` (the module form expands a per-example mask to every head and converts it
    on every call)."""

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d, d))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d))
        self.out_proj = nn.Linear(d, d)
        nn.init.xavier_uniform_(self.in_proj_weight)  # as nn.MultiheadAttention initializes them
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, query: torch.Tensor, source: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = query.shape
        w, bias = self.in_proj_weight, self.in_proj_bias
        q = F.linear(query, w[:d], bias[:d])
        k, v = F.linear(source, w[d:], bias[d:]).chunk(2, -1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, mask, self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, d))


class SASRecBlock(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d, eps=1e-8)
        self.attn = SASRecAttention(d, heads, dropout)
        self.ffn_norm = nn.LayerNorm(d, eps=1e-8)
        self.ffn = nn.Sequential(
            nn.Linear(d, d), FastDropout(dropout), nn.ReLU(), nn.Linear(d, d), FastDropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q = self.attn_norm(x)
        x = q + self.attn(q, x, mask)
        y = self.ffn_norm(x)
        x = y + self.ffn(y)
        return x.masked_fill(pad[..., None], 0.0)


class SASRec(nn.Module):
    def __init__(self, cfg: SASRecConfig, vocab: dict[str, int]):
        super().__init__()
        self.cfg = cfg
        self.num_items = int(vocab["ad_id"])
        self.pad_id = self.num_items  # the extra row: padding (and ids outside the vocabulary)
        self.items = nn.Embedding(self.num_items + 1, cfg.d_model, padding_idx=self.pad_id)
        self.positions = nn.Embedding(cfg.max_len, cfg.d_model)
        self.drop = FastDropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            SASRecBlock(cfg.d_model, cfg.num_heads, cfg.dropout) for _ in range(cfg.num_blocks)
        )
        self.norm = nn.LayerNorm(cfg.d_model, eps=1e-8)
        # The reference implementation's init: Xavier-normal for every matrix, the position table included.
        # PyTorch's own N(0, 1) positions are ~10x the scaled item embeddings (sqrt(d) x ~0.013): the items
        # start drowned in position noise (measured with the reference optimizer, together: see the SASRec
        # convergence section of docs/model-results-sequential.md).
        for param in self.parameters():
            if param.dim() > 1:
                nn.init.xavier_normal_(param)
        with torch.no_grad():
            self.items.weight[self.pad_id].zero_()

    def sequence_states(self, history: Events, user_id: torch.Tensor) -> torch.Tensor:
        """(total, d): the state after each event of the jagged history (causal: it sees events <= itself)."""
        lengths = history.lengths.clamp(max=self.cfg.max_len)
        # Left-padded (B, T) with the last event of every sequence in the last column, as in the reference code,
        # but only as wide as this batch's longest sequence: with the padding keys masked, the states equal those
        # of a max_len-wide batch (the positions are counted from the right).
        b, t = history.batch_size, max(1, int(lengths.max())) if history.batch_size else 1
        end = history.offsets[1:]
        col = torch.arange(t)
        src = end[:, None] - t + col[None]  # flat index of column c
        valid = col[None] >= (t - lengths)[:, None]
        ids = torch.where(valid, history.ad_id[src.clamp(min=0)], torch.full_like(src, self.pad_id))
        ids = torch.where((ids >= 0) & (ids < self.num_items), ids, self.pad_id)  # out of the vocabulary (-1)
        x = self.items(ids) * self.cfg.d_model**0.5 + self.positions(col + self.cfg.max_len - t)[None]
        pad = ~valid
        x = self.drop(x).masked_fill(pad[..., None], 0.0)
        # True = masked: later positions and padding keys; every position sees itself (a padding row would
        # otherwise have no key at all, and its NaN would reach the gradients)
        blocked = (torch.ones(t, t, dtype=torch.bool).triu(1)[None] | pad[:, None, :]) & ~torch.eye(
            t, dtype=torch.bool
        )
        mask = torch.zeros(b, 1, t, t).masked_fill_(blocked[:, None], -torch.inf)  # one mask for every head
        for block in self.blocks:
            x = block(x, mask, pad)
        x = self.norm(x)
        # back to jagged: only the real positions (histories longer than max_len keep their last max_len)
        flat_valid = valid.reshape(-1)
        out = x.reshape(b * t, -1)[flat_valid]
        if int(lengths.sum()) != history.offsets[-1]:
            raise ValueError(f"SASRec reads at most {self.cfg.max_len} events per sequence; slice histories")
        return out

    def query(self, states: torch.Tensor) -> torch.Tensor:
        return states

    def item_vectors(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """(n, d) output embeddings of ``ids`` (every item when None)."""
        table = self.items.weight[: self.num_items]
        return table if ids is None else table[ids.clamp(0, self.num_items - 1)]
