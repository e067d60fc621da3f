"""The bucket kernel (``models.attention.bucket_kernel``) and the packed entry points against plain PyTorch.

``block_forward`` / ``block_backward`` against autograd through a float64 softmax attention; the packed
q/k/v ops against the pad + mask reference (``models.attention.reference``) in fp32 and bf16, forward and
gradients, including the bias tables; the forward-only path (fused SDPA) against the training path.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.attention import bucket_kernel, dispatch, jagged, jagged_layout, reference
from tests.models.attention.test_jagged import (
    BF16,
    FP32,
    abs_score_grads,
    assert_close,
    offsets_of,
    self_inputs,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------- one block
def _bias(kind: str, n: int, heads: int, lq: int, lk: int, gen: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "full":  # a gathered bias table: (n * H, Lq, Lk) with masked (-inf) cells, never a whole row
        bias = torch.randn(n * heads, lq, lk, generator=gen, dtype=torch.float64)
        masked = torch.rand(n * heads, lq, lk, generator=gen) < 0.3
        masked[..., 0] = False
        return bias.masked_fill(masked, float("-inf"))
    if kind == "shared":  # one bias for all sequences: (1, H, Lq, Lk)
        return torch.randn(1, heads, lq, lk, generator=gen, dtype=torch.float64)
    if kind == "causal":
        return torch.full((lq, lk), float("-inf"), dtype=torch.float64).triu(1)
    keys = torch.randint(1, lk + 1, (n,), generator=gen)  # "padding": key-padding mask (n, 1, 1, Lk)
    mask = torch.zeros(n, lk, dtype=torch.float64).masked_fill(
        torch.arange(lk) >= keys[:, None], float("-inf")
    )
    return mask[:, None, None, :]


BLOCKS = [
    (kind, lq, lk) for kind in ("none", "full", "shared", "padding") for lq, lk in ((1, 4), (4, 37), (16, 16))
]


@pytest.mark.parametrize("kind,lq,lk", [*BLOCKS, ("causal", 9, 9), ("causal", 16, 16)])
def test_block_forward_and_backward_match_autograd(kind, lq, lk):
    gen = torch.Generator().manual_seed(lq * 100 + lk)
    n, heads, dim = 3, 2, 8
    q, k, v = (
        torch.randn(n * heads, length, dim, generator=gen, dtype=torch.float64) for length in (lq, lk, lk)
    )
    bias = _bias(kind, n, heads, lq, lk, gen)
    d_out = torch.randn(n * heads, lq, dim, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(dim)

    # plain autograd in float64
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    bias_leaf = bias.clone().requires_grad_() if kind in ("full", "shared") else bias
    scores = scale * leaves[0] @ leaves[1].transpose(1, 2)
    if kind == "full":
        scores = scores + bias_leaf
    elif bias_leaf is not None:  # broadcast over (n, H, Lq, Lk)
        scores = (scores.view(n, heads, lq, lk) + bias_leaf).view(n * heads, lq, lk)
    want = torch.softmax(scores, -1) @ leaves[2]
    want.backward(d_out)

    # the kernel in fp32
    q32, k32, v32, d32 = (t.float() for t in (q, k, v, d_out))
    bias32 = bias.float() if bias is not None else None
    out, probs = bucket_kernel.block_forward(q32, k32, v32, scale, bias32, heads)
    dq, dk, dv = torch.empty_like(q32), torch.empty_like(k32), torch.empty_like(v32)
    ds = bucket_kernel.block_backward(d32, q32, k32, v32, probs, scale, dq, dk, dv)
    assert_close(out, want, **FP32, what="output")
    for name, got, leaf in zip("qkv", (dq, dk, dv), leaves, strict=True):
        assert_close(got, leaf.grad, **FP32, what=f"grad of {name}")
    if kind == "full":
        assert_close(ds, bias_leaf.grad, **FP32, what="grad of the bias cells")
    if kind == "shared":
        assert_close(
            ds.view(n, heads, lq, lk).sum(0, keepdim=True), bias_leaf.grad, **FP32, what="grad of bias"
        )


# ------------------------------------------------------------------------------------ packed entry points
def _grads(out, weights, leaves):
    """d(sum(out * weights)) / d leaf; zeros where the output does not depend on it (e.g. nothing attends)."""
    if not out.requires_grad:  # the fast path returns plain zeros when nothing attends
        return [torch.zeros_like(t) for t in leaves]
    found = torch.autograd.grad((out.float() * weights).sum(), leaves, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, found, strict=True)]


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    causal=st.booleans(),
    tables=st.sampled_from(["none", "pos", "time", "both"]),
    bf16=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_packed_self_attention_matches_reference(lens, causal, tables, bf16, seed):
    """One (total, 3, H, D) tensor in, gradients to it and to the bias tables, as the reference gives them."""
    dtype, tol = (torch.bfloat16, BF16) if bf16 else (torch.float32, FP32)
    pos_r = 4 if tables in ("pos", "both") else None
    time_t = 6 if tables in ("time", "both") else None
    inputs = self_inputs(lens, 2, 8, causal, pos_r, time_t, dtype, seed)
    qkv = torch.stack([inputs[name].detach() for name in "qkv"], 1).requires_grad_()
    rest = {key: inputs[key] for key in ("causal", "pos_bias", "time_bias", "timestamps")}
    tables_ = [t for t in (rest["pos_bias"], rest["time_bias"]) if t is not None]
    weights = torch.randn(qkv.shape[0], 2, 8, generator=torch.Generator().manual_seed(seed + 1))

    ref_leaves = [t.detach().clone().requires_grad_() for t in qkv.unbind(1)]
    ref_tables = [t.detach().clone().requires_grad_() for t in tables_]
    ref_rest = dict(rest)
    it = iter(ref_tables)
    for key in ("pos_bias", "time_bias"):
        if rest[key] is not None:
            ref_rest[key] = next(it)
    want = reference.jagged_self_attention(*ref_leaves, inputs["offsets"], **ref_rest)
    got = jagged.jagged_self_attention_packed(qkv, inputs["offsets"], **rest)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, **tol, what="output")
    grad_qkv, *grad_tables = _grads(got, weights, [qkv, *tables_])
    want_grads = _grads(want, weights, [*ref_leaves, *ref_tables])
    for i, name in enumerate("qkv"):
        assert_close(grad_qkv[:, i], want_grads[i], **tol, what=f"grad of {name}")
    for grad, ref_grad in zip(grad_tables, want_grads[3:], strict=True):
        if not bf16:
            assert_close(grad, ref_grad, **tol, what="grad of a bias table")
            continue
        # bf16 rounds the scores' inputs (2^-8 relative): the table sums may differ by that much of sum |dS|
        bound = tol["atol"] + 2**-8 * float(abs_score_grads(inputs, weights).max())
        err = float((grad.float() - ref_grad.float()).abs().max())
        assert err <= bound, f"grad of a bias table: max error {err:.3g} above {bound:.3g}"


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40)), min_size=1, max_size=6),
    bf16=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_packed_cross_attention_matches_reference(pairs, bf16, seed):
    dtype, tol = (torch.bfloat16, BF16) if bf16 else (torch.float32, FP32)
    gen = torch.Generator().manual_seed(seed)
    q_offsets, kv_offsets = offsets_of([p[0] for p in pairs]), offsets_of([p[1] for p in pairs])
    q = torch.randn(int(q_offsets[-1]), 2, 8, generator=gen).to(dtype).requires_grad_()
    kv = torch.randn(int(kv_offsets[-1]), 2, 2, 8, generator=gen).to(dtype).requires_grad_()
    weights = torch.randn(q.shape, generator=gen)
    ref_q, ref_k, ref_v = (t.detach().clone().requires_grad_() for t in (q, *kv.unbind(1)))
    want = reference.jagged_cross_attention(ref_q, q_offsets, ref_k, ref_v, kv_offsets)
    got = jagged.jagged_cross_attention_packed(q, q_offsets, kv, kv_offsets)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, **tol, what="output")
    grad_q, grad_kv = _grads(got, weights, [q, kv])
    want_q, want_k, want_v = _grads(want, weights, [ref_q, ref_k, ref_v])
    assert_close(grad_q, want_q, **tol, what="grad of q")
    assert_close(grad_kv[:, 0], want_k, **tol, what="grad of k")
    assert_close(grad_kv[:, 1], want_v, **tol, what="grad of v")


def test_padded_slots_repeat_a_row_of_their_own_sequence():
    """A padded slot reads its sequence's last row (any finite row works: nothing real attends to it); the
    heads-first maps move every (row, part, head) to one buffer row and back."""
    offsets = offsets_of([3, 0, 5, 2, 20])
    plan = jagged_layout.plan_self(offsets)
    for bucket in plan.buckets:
        rows = bucket.slot_rows.view(bucket.n, bucket.max_len)
        starts, ends = offsets[bucket.seq], offsets[bucket.seq + 1]
        assert bool(((rows >= starts[:, None]) & (rows < ends[:, None])).all())
        assert torch.equal(rows[bucket.valid], (starts[:, None] + torch.arange(bucket.max_len))[bucket.valid])
    moves = bucket_kernel.heads_first(plan.buckets, 3, 2, int(offsets[-1]))
    assert moves.rows == 3 * 2 * plan.num_slots and moves.gather.numel() == moves.rows
    # every (row, part, head) has exactly one buffer row, and that buffer row reads it back
    assert torch.equal(moves.gather[moves.scatter], torch.arange(int(offsets[-1]) * 3 * 2))


def test_rows_no_bucket_covers_read_the_zero_row():
    """Queries of a sequence without keys (and keys nobody queries) map to the buffer's extra zero row."""
    q_plan, kv_plan = jagged_layout.plan_cross(offsets_of([2, 3, 0]), offsets_of([4, 0, 5]))
    q_moves = bucket_kernel.heads_first(q_plan.buckets, 1, 2, 5)
    kv_moves = bucket_kernel.heads_first(kv_plan.buckets, 2, 2, 9)
    assert bool((q_moves.scatter.view(5, 2)[2:] == q_moves.rows).all())
    assert bool((q_moves.scatter.view(5, 2)[:2] < q_moves.rows).all())
    assert bool((kv_moves.scatter.view(9, 4)[4:] == kv_moves.rows).all())


@pytest.mark.parametrize("causal", [False, True])
def test_forward_only_path_matches_the_training_path(causal):
    """Without gradients the op runs PyTorch's fused SDPA per bucket; with them the bucket kernel."""
    inputs = self_inputs([5, 17, 0, 33, 2], 2, 8, causal, 6, 7, torch.float32, 3)
    trained = jagged.jagged_self_attention(**inputs)
    assert trained.grad_fn is not None and "SelfBuckets" in type(trained.grad_fn).__name__
    with torch.no_grad():
        served = jagged.jagged_self_attention(**inputs)
    assert_close(served, trained, **FP32, what="output")


def test_dispatch_packed_falls_back_to_unbound_views_for_other_backends():
    inputs = self_inputs([4, 0, 7], 2, 4, True, 2, 3, torch.float32, 5)
    qkv = torch.stack([inputs[name].detach() for name in "qkv"], 1)
    rest = {key: inputs[key] for key in ("causal", "pos_bias", "time_bias", "timestamps")}
    via_reference = dispatch.jagged_self_attention_packed(qkv, inputs["offsets"], backend="reference", **rest)
    want = reference.jagged_self_attention(*qkv.unbind(1), inputs["offsets"], **rest)
    assert torch.equal(via_reference, want)
    via_jagged = dispatch.jagged_self_attention_packed(qkv, inputs["offsets"], backend="jagged", **rest)
    assert_close(via_jagged, want, **FP32, what="output")


def test_under_bf16_autocast_the_kernel_stays_fp32_and_matches_the_reference():
    """A block trained under ``torch.autocast`` (bench/gpu_attention.py's user-model step): the kernel's GEMMs
    must not be autocast to bf16 (mixed with its fp32 buffers they would fail)."""
    from models.architectures.layers import TransformerBlock

    offsets = offsets_of([5, 0, 17, 9, 33])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(int(offsets[-1]), 16, generator=gen)
    ts = torch.cumsum(torch.randint(1, 3600, (int(offsets[-1]),), generator=gen), 0)
    results = []
    for backend in ("reference", "jagged"):
        torch.manual_seed(0)
        block = TransformerBlock(16, 2, 2, 0.0, causal=True, max_rel_pos=4, time_buckets=8, backend=backend)
        with torch.no_grad():
            block.attn.pos_bias.normal_(0, 0.5)
            block.attn.time_bias.normal_(0, 0.5)
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(leaf, offsets, ts)
        out.float().square().mean().backward()
        results.append((out, leaf.grad, block.attn.pos_bias.grad, block.attn.time_bias.grad))
    for name, got, want in zip(("output", "x", "pos_bias", "time_bias"), results[1], results[0], strict=True):
        assert_close(got, want, **BF16, what=name)
