"""DeepSpeed MoE blocks export to the plain-PyTorch ``MixtureOfExperts`` with the same weights and gating.

Single process here (ep_size 1); the 2-rank run with ep_size 2 that gathers experts from both ranks is in
``test_launch.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.architectures.layers import FeedForward, MixtureOfExperts, TransformerBlock, use_moe_ffn
from models.training.distributed.config import MoEConfig
from models.training.distributed.moe import MoEFeedForward, export_state_dict


def _blocks(ffn: nn.Module) -> nn.Module:
    """A module whose MoE sits where the user model's does: ``blocks.0.ffn``."""
    holder = nn.Module()
    holder.blocks = nn.ModuleList([nn.ModuleDict({"ffn": ffn})])
    return holder


@pytest.mark.parametrize("top_k", [1, 2])
def test_plain_moe_reproduces_deepspeed_moe_eval(top_k):
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=top_k, capacity_factor=1.0, min_capacity=4)
    ds = _blocks(MoEFeedForward(32, 2, 0.0, cfg, seed=3)).eval()
    x = torch.randn(200, 32)
    with torch.no_grad():
        expected = ds.blocks[0]["ffn"](x)
    state = export_state_dict(ds, {k: v.clone() for k, v in ds.state_dict().items()}, rank=0)
    plain = _blocks(MixtureOfExperts(32, 2, 0.0, num_experts=4, top_k=top_k)).eval()
    plain.load_state_dict(state)  # strict: every gate / expert weight has its place, nothing left over
    with torch.no_grad():
        got = plain.blocks[0]["ffn"](x)
    # 200 tokens over 4 experts with capacity factor 1: training would drop tokens, evaluation drops none
    counts = ds.blocks[0]["ffn"].expert_counts
    assert counts.max() > 200 * top_k / 4
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_plain_moe_routes_each_token_to_its_top_expert_scaled_by_the_gate():
    torch.manual_seed(1)
    moe = MixtureOfExperts(8, 2, 0.0, num_experts=3, top_k=1)
    x = torch.randn(10, 8)
    probs = torch.softmax(x @ moe.gate.weight.T, -1)
    best = probs.argmax(-1)
    expected = torch.stack([moe.experts[int(e)](x[i]) * probs[i, e] for i, e in enumerate(best)])
    torch.testing.assert_close(moe(x), expected)


def test_use_moe_ffn_swaps_only_the_named_blocks_and_keeps_widths():
    blocks = nn.ModuleList(
        TransformerBlock(16, 2, 3, 0.1, causal=True, max_rel_pos=4, time_buckets=0, backend="reference")
        for _ in range(3)
    )
    assert use_moe_ffn(blocks, ["dense", "moe", "dense"], num_experts=4, top_k=2) == 1
    assert isinstance(blocks[0].ffn, FeedForward) and isinstance(blocks[1].ffn, MixtureOfExperts)
    expert = blocks[1].ffn.experts[3].net
    assert (expert[0].in_features, expert[0].out_features, expert[3].p) == (16, 48, 0.1)
    with pytest.raises(ValueError, match="top_k=5"):
        MixtureOfExperts(16, 2, 0.0, num_experts=4, top_k=5)
