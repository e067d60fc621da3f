"""The next-item query of ONE user at request time (``UserModel.sequence_states`` + ``query``, the state after
the last event), scriptable with TorchScript: what a server's fresh retrieval query runs.

Why: the eager path (``models.embeddings.sequences.query_vectors``) is ~400 small torch ops and Python calls for
one user (jagged layout, torchrec-shaped lookups, validation), each releasing and re-taking the GIL beside the
server's scoring threads. Its p50 was 1.4 ms alone, and in a server at 100 req/s the fresh query took the end
to end p99 from 8 to 38 ms (docs/retrieval.md). With one user the jagged layout is one dense causal block, and
the last block needs only the last event's row. The module holds the user model's own layers and tables (no
copies); ``tests/models/test_one_user_query.py`` compares it with the eager path.

Inputs are what ``query_vectors`` builds before the model (ids mapped to the model's rows, gap buckets) plus the
(n, n) time-bias buckets, computed by the caller with ``models.architectures.transforms.time_bucket``.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.architectures.tokenizer import GAP_TABLE
from models.attention.reference import pos_bucket
from models.training.batch import EVENT_ID_FIELDS

FIELDS = (*EVENT_ID_FIELDS, GAP_TABLE)  # the order of ``forward``'s ``ids``


class OneUserSelfBlock(nn.Module):
    """``TransformerBlock`` (pre-norm causal self-attention with relative position / time biases, FFN) over one
    user's events; ``last_only``: the output for the last event alone."""

    pos_bias: Optional[torch.Tensor]  # noqa: UP045 (TorchScript reads typing.Optional, not X | None)
    time_bias: Optional[torch.Tensor]  # noqa: UP045

    def __init__(self, block, causal: bool):
        super().__init__()
        up, _, down, _ = block.ffn.net  # Linear, GELU, Linear, Dropout (identity in eval)
        self.norm1, self.qkv, self.out = block.norm1, block.attn.qkv, block.attn.out
        self.norm2, self.up, self.down = block.norm2, up, down
        self.heads, self.causal = block.attn.heads, causal
        self.pos_bias, self.time_bias = block.attn.pos_bias, block.attn.time_bias

    def forward(self, x: torch.Tensor, time_idx: torch.Tensor, last_only: bool) -> torch.Tensor:
        n, d = x.shape
        head_dim = d // self.heads
        qkv = self.qkv(self.norm1(x)).view(n, 3, self.heads, head_dim)
        q, k, v = qkv[:, 0].transpose(0, 1), qkv[:, 1].transpose(0, 1), qkv[:, 2].transpose(0, 1)  # (H, n, D)
        rows = torch.arange(n - 1 if last_only else 0, n)
        if last_only:
            q, x = q[:, -1:], x[-1:]
        scores = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(head_dim)  # (H, rows, n)
        pos_bias, time_bias = self.pos_bias, self.time_bias
        if pos_bias is not None:
            max_rel = (pos_bias.shape[1] - 1) // 2
            scores = scores + pos_bias[:, pos_bucket(rows[:, None] - torch.arange(n)[None, :], max_rel)]
        if time_bias is not None:
            scores = scores + time_bias[:, time_idx[rows]]
        if self.causal:
            scores = scores.masked_fill(torch.arange(n)[None, :] > rows[:, None], float("-inf"))
        attended = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(0, 1).reshape(-1, d)
        x = x + self.out(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class OneUserQuery(nn.Module):
    """(d,) next-item query of one user's events: ``ids`` = the rows of ``FIELDS`` (each (n,) int64, n >= 1),
    ``time_idx`` (n, n) the time-bias bucket of ``ts[i] - ts[j]``."""

    attributes: Optional[torch.Tensor]  # noqa: UP045

    def __init__(self, model):
        super().__init__()
        sparse = model.sparse
        self.tables = [sparse.table(sparse.features[f"hist_{f}"]).detach() for f in FIELDS]
        self.sizes = [sparse.sizes[sparse.features[f"hist_{f}"]] for f in FIELDS]
        self.attributes = (
            None if model.items is None else model.frozen_attribute_table().detach()
        )  # fmt: skip
        self.token_norm = model.events.norm
        self.blocks = nn.ModuleList(OneUserSelfBlock(b, model.cfg.causal) for b in model.blocks)
        self.norm, self.next_proj = model.norm, model.next_proj
        self.temperature = float(model.cfg.next_item_temperature)

    @staticmethod
    def supports(model) -> bool:
        """A next-item transformer user model whose FFNs are the dense ones (not a mixture of experts)."""
        cfg = model.cfg
        return (
            getattr(cfg, "objective", "") == "next_item"
            and cfg.pooling == "transformer"
            and len(model.blocks) > 0
            and all(len(getattr(b.ffn, "net", ())) == 4 for b in model.blocks)
        )

    def forward(self, ids: list[torch.Tensor], time_idx: torch.Tensor) -> torch.Tensor:
        tokens = torch.zeros(0)
        for i, table in enumerate(self.tables):
            size = self.sizes[i]
            rows = torch.where((ids[i] >= 0) & (ids[i] < size), ids[i], size)  # tokenizer.oov_ids
            emb = F.embedding(rows, table)
            tokens = emb if i == 0 else tokens + emb
        attributes = self.attributes
        if attributes is not None:
            tokens = tokens + F.embedding(ids[0].clamp(0, attributes.shape[0] - 1), attributes)
        x = self.token_norm(tokens)
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            x = block(x, time_idx, i == last)
        query = self.next_proj(self.norm(x[-1]))
        return F.normalize(query, dim=-1) / self.temperature


@torch.no_grad()
def script_query(model) -> "torch.jit.ScriptModule | None":
    """``OneUserQuery`` of ``model`` compiled by TorchScript, or None where it does not apply."""
    if not OneUserQuery.supports(model):
        return None
    return torch.jit.script(OneUserQuery(model).eval())
