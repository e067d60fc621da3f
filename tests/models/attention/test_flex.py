"""torch's FlexAttention backend (measured beside ours by ``bench/jagged.py``, issue 40) equals the reference, so
its figures are those of a correct implementation. Forward only: FlexAttention has no backward on CPU."""

from __future__ import annotations

import torch

from models.attention import flex, reference
from tests.models.attention.test_jagged import FP32, assert_close, cross_inputs, self_inputs


def detached(inputs: dict) -> dict:  # torch refuses any input that requires grad on CPU
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def test_self_attention_with_the_relative_bias_matches_reference():
    inputs = detached(self_inputs([0, 1, 5, 23, 9], 2, 8, True, 3, 24, torch.float32, seed=3))
    # gaps at bucket edges: with 1 + gap = 2^22 - 1, float32 log2 rounds up to 22 and picks the next bucket
    inputs["timestamps"] = (
        torch.tensor([0, 2**20 - 1, 2**20, 2**21 - 1, 2**22 - 2, 2**22]).repeat(7)[:38].cumsum(0)
    )
    assert_close(flex.jagged_self_attention(**inputs), reference.jagged_self_attention(**inputs), **FP32,
                     what="output")  # fmt: skip


def test_cross_attention_matches_reference_including_a_sequence_without_keys():
    inputs = detached(cross_inputs([3, 2, 0, 4], [7, 0, 5, 12], 2, 8, torch.float32, seed=5))
    assert_close(flex.jagged_cross_attention(**inputs), reference.jagged_cross_attention(**inputs), **FP32,
                     what="output")  # fmt: skip
