"""Compiled dense regions (``models.inference.compile``) against eager and the plain-PyTorch attention reference.

Within the tolerances the jagged attention tests use (``tests.models.attention.test_jagged``): forward and the
gradients of every parameter and input, fp32 and bf16, over jagged batches of several sizes (one compiled graph
with dynamic shapes must serve them all).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from models.architectures.layers import TargetAwareBlock, TransformerBlock
from models.inference import compile as compile_mod
from tests.models.attention.test_jagged import BF16, FP32, assert_close, offsets_of


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    why = compile_mod.probe()  # at run time, not collection: the probe itself compiles
    if why is not None:
        pytest.skip(f"inductor cannot build here: {why}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _grads(module, inputs, out, weights):
    leaves = [p for p in module.parameters()] + [t for t in inputs if t.requires_grad]
    return torch.autograd.grad((out.float() * weights).sum(), leaves, allow_unused=True)


def _check(eager, compiled, run, dtype, lens_list, tol):
    for seed, lens in enumerate(lens_list):
        gen = torch.Generator().manual_seed(seed)
        ref_out, ref_inputs = run(eager, gen_seed=seed)
        out, inputs = run(compiled, gen_seed=seed)
        weights = torch.randn(ref_out.shape, generator=gen)
        assert out.dtype == dtype
        assert_close(out, ref_out, **tol, what=f"output, lens {lens}")
        for i, (g, rg) in enumerate(
            zip(
                _grads(compiled, inputs, out, weights),
                _grads(eager, ref_inputs, ref_out, weights),
                strict=True,
            )
        ):
            if rg is None:
                assert g is None or not g.abs().any()
                continue
            assert_close(g, rg, **tol, what=f"grad {i}, lens {lens}")


LENS = [[5, 0, 17, 3], [40, 1, 9], [2, 2, 2, 2, 30, 11]]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.bfloat16, BF16)])
@pytest.mark.parametrize("backend", ["jagged", "reference"])
def test_compiled_transformer_block_matches_eager_and_the_reference(dtype, tol, backend):
    torch.manual_seed(0)
    eager = TransformerBlock(32, 4, 2, 0.0, causal=True, max_rel_pos=4, time_buckets=8, backend=backend).to(
        dtype
    )
    with torch.no_grad():  # non-zero biases so their gradients are exercised
        eager.attn.pos_bias.normal_(0, 0.5)
        eager.attn.time_bias.normal_(0, 0.5)
    reference = copy.deepcopy(eager)
    reference.attn.backend = "reference"
    compiled = copy.deepcopy(eager)
    assert compile_mod.compile_dense(compiled, "on") == [
        "TransformerBlock.project_qkv",
        "TransformerBlock.finish",
    ]

    def run(module, gen_seed):
        lens = LENS[gen_seed]
        gen = torch.Generator().manual_seed(100 + gen_seed)
        offsets = offsets_of(lens)
        x = torch.randn(int(offsets[-1]), 32, generator=gen).to(dtype).requires_grad_()
        ts = torch.randint(0, 5_000, (int(offsets[-1]),), generator=gen)
        return module(x, offsets, ts), [x]

    _check(reference, compiled, run, dtype, LENS, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.bfloat16, BF16)])
def test_compiled_target_aware_block_matches_eager(dtype, tol):
    torch.manual_seed(0)
    eager = TargetAwareBlock(32, 4, 2, 0.0, backend="reference").to(dtype)
    compiled = copy.deepcopy(eager)
    compiled.attn.backend = "jagged"
    names = compile_mod.compile_dense(compiled, "on")
    assert names == [f"TargetAwareBlock.{m}" for m in ("context_kv", "project_query", "finish")]

    def run(module, gen_seed):
        q_lens, kv_lens = LENS[gen_seed], [4] * len(LENS[gen_seed])
        gen = torch.Generator().manual_seed(200 + gen_seed)
        q_off, kv_off = offsets_of(q_lens), offsets_of(kv_lens)
        q = torch.randn(int(q_off[-1]), 32, generator=gen).to(dtype).requires_grad_()
        ctx = torch.randn(int(kv_off[-1]), 32, generator=gen).to(dtype).requires_grad_()
        return module(q, q_off, module.context_kv(ctx), kv_off), [q, ctx]

    _check(eager, compiled, run, dtype, LENS, tol)


def test_compile_keeps_the_state_dict_and_skips_moe_finish():
    from models.architectures.layers import use_moe_ffn

    blocks = torch.nn.ModuleList(
        TransformerBlock(16, 2, 2, 0.0, causal=True, max_rel_pos=0, time_buckets=0, backend="jagged")
        for _ in range(2)
    )
    use_moe_ffn(blocks, ["dense", "moe"], num_experts=2, top_k=1)
    keys = list(blocks.state_dict())
    names = compile_mod.compile_dense(blocks, "on")
    assert names == ["0.project_qkv", "0.finish", "1.project_qkv"]
    assert list(blocks.state_dict()) == keys
    assert compile_mod.is_compiled(blocks[0], "finish") and not compile_mod.is_compiled(blocks[1], "finish")


def test_auto_falls_back_to_eager_with_one_logged_line(monkeypatch, caplog):
    block = TransformerBlock(16, 2, 2, 0.0, causal=True, max_rel_pos=0, time_buckets=0, backend="jagged")
    monkeypatch.setattr(compile_mod, "probe", lambda: "InvalidCxxCompiler: no working C++ compiler found")
    with caplog.at_level(logging.WARNING, logger="gemflow.compile"):
        assert compile_mod.compile_dense(block, "auto") == []
    assert len(caplog.records) == 1 and "runs eager" in caplog.records[0].getMessage()
    assert not compile_mod.is_compiled(block, "finish")
    assert compile_mod.compile_dense(block, "off") == []
    with pytest.raises(ValueError, match="compile mode"):
        compile_mod.compile_dense(block, "fast")


def test_loading_the_models_leaves_the_compiler_unimported():
    """``models.attention.dispatch``'s boundaries are plain wrappers until something compiles: a process that
    builds and runs a model (the server) never imports torch._dynamo (~145 MB and ~2 s with sympy and triton)."""
    import subprocess
    import sys

    probe = (
        "import sys, torch\n"
        "from models.architectures.layers import TargetAwareBlock\n"
        "block = TargetAwareBlock(16, 2, 2, 0.0, 'jagged').eval()\n"
        "q, kv = torch.randn(3, 16), block.context_kv(torch.randn(5, 16))\n"
        "block(q, torch.tensor([0, 1, 3]), kv, torch.tensor([0, 2, 5]))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_compiled_code_breaks_its_graph_at_the_attention_call():
    """Once compiling starts, the attention entry points are ``torch.compiler.disable``d: a compiled function
    that calls one stops its graph there (and the result is the eager one)."""
    from models.attention.dispatch import jagged_cross_attention, stop_compiles_at_boundaries

    stop_compiles_at_boundaries()
    q, k, v = torch.randn(3, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    q_off, kv_off = torch.tensor([0, 1, 3]), torch.tensor([0, 2, 5])

    def around(q, k, v):
        return jagged_cross_attention(q * 2, q_off, k, v, kv_off, backend="jagged").relu()

    explained = torch._dynamo.explain(around)(q, k, v)
    assert explained.graph_break_count >= 1
    assert any("disable" in str(b.reason) for b in explained.break_reasons)
    torch.testing.assert_close(torch.compile(around)(q, k, v), around(q, k, v))
