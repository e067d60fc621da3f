"""SASRec's attention is nn.MultiheadAttention's, state dict and outputs, with one mask shared by the heads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.sequential.sasrec import SASRecAttention


@pytest.mark.parametrize("heads", [1, 2])
def test_same_state_dict_and_outputs_as_multihead_attention(heads):
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(8, heads, dropout=0.5, batch_first=True).eval()
    ours = SASRecAttention(8, heads, 0.5).eval()
    assert set(ours.state_dict()) == set(reference.state_dict())  # older SASRec runs load unchanged
    ours.load_state_dict(reference.state_dict())
    query, source = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    blocked = (torch.rand(3, 5, 5) > 0.5) & ~torch.eye(5, dtype=torch.bool)  # every row keeps itself
    expected = reference(
        query, source, source, attn_mask=blocked.repeat_interleave(heads, 0), need_weights=False
    )
    mask = torch.zeros(3, 1, 5, 5).masked_fill_(blocked[:, None], -torch.inf)
    torch.testing.assert_close(ours(query, source, mask), expected[0])
