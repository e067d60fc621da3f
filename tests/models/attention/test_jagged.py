"""The jagged CPU attention path against the pad + mask reference: forward and backward, on random jagged batches."""

from __future__ import annotations

import math
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.attention import dispatch, jagged, jagged_layout, jagged_plan, reference

FP32 = dict(atol=2e-5, rtol=2e-5)
BF16 = dict(atol=3e-2, rtol=3e-2)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These shapes are tiny: a second intra-op thread only adds sync cost (10x on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def offsets_of(lens: list[int]) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lens, dtype=torch.long).cumsum(0)])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    """Elementwise |a - e| <= atol + rtol * max|e| (a scale-aware bound: bf16 errors follow the largest values)."""
    actual, expected = actual.detach().float(), expected.detach().float()
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    err = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert err <= atol + rtol * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


def run_self(module, inputs: dict, weights: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    leaves = [inputs[name] for name in ("q", "k", "v", "pos_bias", "time_bias")]
    out = module.jagged_self_attention(**inputs)
    return out, grads_of(out, weights, leaves)


def grads_of(out: torch.Tensor, weights: torch.Tensor, leaves: list) -> list[torch.Tensor | None]:
    """d(sum(out * weights)) / d leaf; zeros where the output does not depend on a leaf (e.g. an empty batch)."""
    wanted = [t for t in leaves if t is not None]
    if out.requires_grad:
        found = torch.autograd.grad((out.float() * weights).sum(), wanted, allow_unused=True)
    else:  # both backends return plain zeros when nothing attends
        found = [None] * len(wanted)
    it = (torch.zeros_like(t) if g is None else g for t, g in zip(wanted, found, strict=True))
    return [None if t is None else next(it) for t in leaves]


def self_inputs(lens, heads, dim, causal, pos_r, time_t, dtype, seed) -> dict:
    gen = torch.Generator().manual_seed(seed)
    offsets = offsets_of(lens)
    total = int(offsets[-1])

    def leaf(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype).requires_grad_()

    inputs = dict(q=leaf(total, heads, dim), k=leaf(total, heads, dim), v=leaf(total, heads, dim))
    inputs |= dict(offsets=offsets, causal=causal, pos_bias=None, time_bias=None, timestamps=None)
    if pos_r is not None:
        inputs["pos_bias"] = (0.5 * torch.randn(heads, 2 * pos_r + 1, generator=gen)).requires_grad_()
    if time_t is not None:
        inputs["time_bias"] = (0.5 * torch.randn(heads, time_t, generator=gen)).requires_grad_()
        inputs["timestamps"] = torch.randint(0, 5_000, (total,), generator=gen)
    return inputs


def launch_cells(value: int):
    """Set the planner's per-call cost: 0 keeps every length class its own bucket, so tiny test batches still
    run through many buckets; the default merges them (both layouts must match the reference)."""
    return patch.object(jagged_layout, "LAUNCH_CELLS", value)


launch_costs = st.sampled_from([0, jagged_layout.LAUNCH_CELLS])


def check_self(lens, heads, dim, causal, pos_r, time_t, dtype, seed, tol, launch=0) -> None:
    inputs = self_inputs(lens, heads, dim, causal, pos_r, time_t, dtype, seed)
    weights = torch.randn(inputs["q"].shape, generator=torch.Generator().manual_seed(seed + 1))
    ref_out, ref_grads = run_self(reference, inputs, weights)
    with launch_cells(launch):
        out, grads = run_self(jagged, inputs, weights)
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    assert_close(out, ref_out, **tol, what="output")
    for name, grad, ref_grad in zip(("q", "k", "v", "pos_bias", "time_bias"), grads, ref_grads, strict=True):
        if ref_grad is None:
            assert grad is None, name
            continue
        assert grad.dtype == ref_grad.dtype, name
        if name.endswith("_bias") and dtype == torch.bfloat16:
            # A table gradient sums dS over many cells that SDPA rounds to bf16 (2^-8 relative each): its
            # error is bounded by 2^-8 x sum |dS|, however close to zero the exact sum cancels.
            bound = tol["atol"] + 2**-8 * float(abs_score_grads(inputs, weights).max())
            err = float((grad.float() - ref_grad.float()).abs().max())
            assert err <= bound, f"grad of {name}: max error {err:.3g} above {bound:.3g}"
            continue
        assert_close(grad, ref_grad, **tol, what=f"grad of {name}")


def abs_score_grads(inputs: dict, weights: torch.Tensor) -> torch.Tensor:
    """(H,) sum over all attended cells of |dS| (dS: gradient of the pre-softmax score), in fp32."""
    q, k, v = (inputs[name].detach().float() for name in ("q", "k", "v"))
    offsets = inputs["offsets"]
    (qp, mask), (kp, _), (vp, _), (wp, _) = (reference.pad(t, offsets) for t in (q, k, v, weights.float()))
    n = qp.shape[1]
    ts = reference.pad(inputs["timestamps"], offsets)[0] if inputs["timestamps"] is not None else None
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp) / math.sqrt(q.shape[-1])
    bias = reference.relative_bias(ts, n, inputs["pos_bias"], inputs["time_bias"])
    scores = scores + (bias.detach().float() if bias is not None else 0.0)
    allowed = mask[:, None, None, :] & mask[:, None, :, None]
    if inputs["causal"]:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    dprobs = torch.einsum("bihd,bjhd->bhij", wp, vp)
    return (probs * (dprobs - (probs * dprobs).sum(-1, keepdim=True))).abs().sum((0, 2, 3))


lengths = st.lists(st.integers(0, 24), min_size=0, max_size=6)
bias_r = st.none() | st.integers(1, 5)
bias_t = st.none() | st.integers(1, 8)


@settings(max_examples=60, deadline=None)
@given(
    lens=lengths,
    heads=st.integers(1, 3),
    dim=st.sampled_from([4, 8]),
    causal=st.booleans(),
    pos_r=bias_r,
    time_t=bias_t,
    seed=st.integers(0, 2**31 - 1),
    launch=launch_costs,
)
def test_self_attention_matches_reference_fp32(lens, heads, dim, causal, pos_r, time_t, seed, launch):
    check_self(lens, heads, dim, causal, pos_r, time_t, torch.float32, seed, FP32, launch)


@settings(max_examples=25, deadline=None)
@given(lens=lengths, causal=st.booleans(), pos_r=bias_r, time_t=bias_t, seed=st.integers(0, 2**31 - 1))
def test_self_attention_matches_reference_bf16(lens, causal, pos_r, time_t, seed):
    check_self(lens, 2, 8, causal, pos_r, time_t, torch.bfloat16, seed, BF16)


@pytest.mark.parametrize("launch", [0, jagged_layout.LAUNCH_CELLS])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_spanning_many_buckets(causal, launch):
    """Lengths across the short class and several geometric ones, with both biases (the user model's layer)."""
    check_self(
        [0, 1, 2, 16, 17, 19, 33, 70, 0, 101, 250], 2, 8, causal, 8, 12, torch.float32, 7, FP32, launch
    )


@pytest.mark.parametrize("causal", [False, True])
def test_equal_lengths_move_no_rows_and_match_reference(causal):
    """Histories that all fill max_history lay out as the jagged tensor itself (no copy in or out)."""
    assert jagged_layout.plan_self(offsets_of([6, 6, 6])).identity
    assert jagged_layout.plan_self(offsets_of([6, 0, 6])).identity  # an empty sequence owns no rows
    assert not jagged_layout.plan_self(offsets_of([6, 5, 6])).identity  # one padded slot
    check_self([6, 6, 6], 2, 4, causal, 3, 5, torch.float32, 11, FP32)
    check_self([6, 0, 6], 2, 4, causal, 3, 5, torch.float32, 12, FP32)


def test_empty_batch_and_all_empty_sequences():
    for lens in ([], [0, 0, 0]):
        inputs = self_inputs(lens, 2, 4, True, 2, 3, torch.float32, 0)
        out = jagged.jagged_self_attention(**inputs)
        assert out.shape == (0, 2, 4)


def test_length_one_sequences_return_their_value():
    inputs = self_inputs([1, 1, 1], 2, 4, False, 2, 3, torch.float32, 0)
    out = jagged.jagged_self_attention(**inputs)
    assert_close(out, inputs["v"], **FP32, what="output")


# --------------------------------------------------------------------------------------------- cross attention
def cross_inputs(q_lens, kv_lens, heads, dim, dtype, seed) -> dict:
    gen = torch.Generator().manual_seed(seed)
    q_offsets, kv_offsets = offsets_of(q_lens), offsets_of(kv_lens)

    def leaf(rows):
        return torch.randn(rows, heads, dim, generator=gen).to(dtype).requires_grad_()

    return dict(
        q=leaf(int(q_offsets[-1])),
        q_offsets=q_offsets,
        k=leaf(int(kv_offsets[-1])),
        v=leaf(int(kv_offsets[-1])),
        kv_offsets=kv_offsets,
    )


def run_cross(module, inputs, weights):
    out = module.jagged_cross_attention(**inputs)
    return out, grads_of(out, weights, [inputs["q"], inputs["k"], inputs["v"]])


@settings(max_examples=50, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 30)), min_size=0, max_size=6),
    heads=st.integers(1, 3),
    bf16=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    launch=launch_costs,
)
def test_cross_attention_matches_reference(pairs, heads, bf16, seed, launch):
    q_lens, kv_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    dtype, tol = (torch.bfloat16, BF16) if bf16 else (torch.float32, FP32)
    inputs = cross_inputs(q_lens, kv_lens, heads, 8, dtype, seed)
    weights = torch.randn(inputs["q"].shape, generator=torch.Generator().manual_seed(seed + 1))
    ref_out, ref_grads = run_cross(reference, inputs, weights)
    with launch_cells(launch):
        out, grads = run_cross(jagged, inputs, weights)
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    assert_close(out, ref_out, **tol, what="output")
    for name, grad, ref_grad in zip("qkv", grads, ref_grads, strict=True):
        assert_close(grad, ref_grad, **tol, what=f"grad of {name}")


def test_cross_attention_queries_without_keys_are_zero_and_get_zero_grads():
    # sequence 1 has 3 queries and no keys; sequence 2 has keys but no queries.
    inputs = cross_inputs([2, 3, 0, 1], [5, 0, 4, 1], 2, 4, torch.float32, 3)
    out = jagged.jagged_cross_attention(**inputs)
    assert torch.all(out[2:5] == 0)
    assert torch.all(out[:2] != 0) and torch.all(out[5] != 0)
    out.sum().backward()
    assert torch.all(inputs["q"].grad[2:5] == 0)
    assert torch.all(inputs["k"].grad[5:9] == 0)  # keys nobody queries get no gradient


def test_cross_attention_many_candidates_against_one_sequence():
    """The ranker's shape: N candidates (queries) over one user's keys."""
    inputs = cross_inputs([300], [40], 2, 8, torch.float32, 5)
    weights = torch.randn(inputs["q"].shape)
    ref_out, ref_grads = run_cross(reference, inputs, weights)
    out, grads = run_cross(jagged, inputs, weights)
    assert_close(out, ref_out, **FP32, what="output")
    for name, grad, ref_grad in zip("qkv", grads, ref_grads, strict=True):
        assert_close(grad, ref_grad, **FP32, what=f"grad of {name}")


# ---------------------------------------------------------------------------------------------------- layout
def self_cost(plan) -> int:
    """Attention cells computed (padding included) plus the launch cost per bucket: what the planner minimizes."""
    return sum(b.size * b.max_len + jagged_layout.LAUNCH_CELLS for b in plan.buckets)


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.integers(0, 2_000), min_size=0, max_size=40))
def test_buckets_cover_every_row_once_and_cost_no_more_than_length_classes(lens):
    offsets = offsets_of(lens)
    plan = jagged_layout.plan_self(offsets)
    assert sorted(plan.rows.tolist()) == list(range(int(offsets[-1])))
    assert len(set(plan.slots.tolist())) == plan.slots.numel()
    assert plan.num_slots == sum(bucket.size for bucket in plan.buckets)
    for bucket in plan.buckets:
        assert bucket.valid.sum(1).tolist() == torch.tensor(lens)[bucket.seq].tolist()
    lens_t = torch.tensor(lens, dtype=torch.long)
    classes = jagged_layout.group_sequences(jagged_layout.length_class(lens_t), lens_t > 0)
    for seq in classes:  # each class alone stays within the padding budget
        low, high = int(lens_t[seq].min()), int(lens_t[seq].max())
        assert high <= max(jagged_layout.SHORT_LEN, (1 + jagged_layout.PAD_BUDGET) * low)
    assert self_cost(plan) <= self_cost(jagged_layout.layout(classes, offsets))


@settings(max_examples=60, deadline=None)
@given(
    q_lens=st.lists(st.integers(0, 60), min_size=1, max_size=30),
    kv_lens=st.lists(st.integers(0, 60), min_size=1, max_size=30),
)
def test_no_bucket_pads_a_short_key_sequence_past_the_kv_cliff(q_lens, kv_lens):
    """Keys of <= KV_CLIFF are never padded into a longer-key bucket (the fused CPU kernel costs ~3x there)."""
    n = min(len(q_lens), len(kv_lens))
    q_lens, kv_lens = q_lens[:n], kv_lens[:n]
    kv = torch.tensor(kv_lens)
    _, kv_plan = jagged_layout.plan_cross(offsets_of(q_lens), offsets_of(kv_lens))
    plans = [(kv_plan, kv), (jagged_layout.plan_self(offsets_of(kv_lens)), kv)]
    for plan, lens in plans:
        for bucket in plan.buckets:
            if bucket.max_len > jagged_layout.KV_CLIFF:
                assert int(lens[bucket.seq].min()) > jagged_layout.KV_CLIFF, (
                    bucket.max_len,
                    lens[bucket.seq],
                )


def contiguous_partitions(n: int):
    if n == 0:
        yield []
        return
    for first in range(1, n + 1):
        for rest in contiguous_partitions(n - first):
            yield [first, *rest]


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 300), st.integers(1, 300)), max_size=6),
    launch=st.integers(0, 50_000),
)
def test_merge_groups_is_optimal(groups, launch):
    """The dynamic programme finds the cheapest contiguous merge (checked against all 2^(n-1) of them)."""
    q_lens, kv_lens, ids, start = [], [], [], 0
    for count, q_len, kv_len in groups:
        q_lens += [q_len] * count
        kv_lens += [kv_len] * count
        ids.append(torch.arange(start, start + count))
        start += count
    q_t, kv_t = torch.tensor(q_lens, dtype=torch.long), torch.tensor(kv_lens, dtype=torch.long)

    def cost(buckets):
        return sum(len(b) * int(q_t[b].max()) * int(kv_t[b].max()) + launch for b in buckets)

    merged = jagged_layout.merge_groups(ids, q_t, kv_t, launch_cells=launch)
    assert [i for bucket in merged for i in bucket.tolist()] == list(range(start))
    brute = []
    for sizes in contiguous_partitions(len(ids)):
        cuts = torch.tensor([0, *sizes]).cumsum(0).tolist()
        brute.append(cost([torch.cat(ids[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]))
    assert cost(merged) == min(brute)


# ---------------------------------------------------------------------------------------- plan reuse
def plan_args(inputs: dict) -> dict:
    return dict(
        causal=inputs["causal"],
        heads=inputs["q"].shape[1],
        pos_columns=inputs["pos_bias"].shape[1],
        time_columns=inputs["time_bias"].shape[1],
    )


def test_plan_is_built_once_per_batch_and_rebuilt_when_its_inputs_change():
    """Layers of one pass share the plan (the per-cell bias index); other or mutated inputs get a new one."""
    inputs = self_inputs([5, 0, 9, 3], 2, 4, True, 3, 6, torch.float32, 1)
    offsets, ts = inputs["offsets"], inputs["timestamps"]
    first = jagged_plan.cached_plan_self_attention(offsets, ts, **plan_args(inputs))
    assert jagged_plan.cached_plan_self_attention(offsets.clone(), ts.clone(), **plan_args(inputs)) is first
    assert (
        jagged_plan.cached_plan_self_attention(offsets, ts, **plan_args(inputs) | dict(causal=False))
        is not first
    )
    ts.add_(1_000)  # in place: a stale plan would keep the old time buckets
    rebuilt = jagged_plan.cached_plan_self_attention(offsets, ts, **plan_args(inputs))
    assert rebuilt is not first
    for layer_seed in (2, 3):  # two "layers": own tables, same plan
        layer = self_inputs([5, 0, 9, 3], 2, 4, True, 3, 6, torch.float32, layer_seed) | dict(timestamps=ts)
        weights = torch.randn(layer["q"].shape, generator=torch.Generator().manual_seed(layer_seed))
        (ref_out, ref_grads), (out, grads) = (run_self(m, layer, weights) for m in (reference, jagged))
        assert jagged_plan.cached_plan_self_attention(offsets, ts, **plan_args(inputs)) is rebuilt
        assert_close(out, ref_out, **FP32, what="output")
        for grad, ref_grad in zip(grads, ref_grads, strict=True):
            assert_close(grad, ref_grad, **FP32, what="grad")
    jagged_plan.clear_plan_cache()
    assert jagged_plan.cached_plan_self_attention(offsets, ts, **plan_args(inputs)) is not rebuilt


def test_plan_from_inference_mode_is_not_reused_for_training():
    inputs = self_inputs([4, 7], 2, 4, True, 2, 5, torch.float32, 4)
    with torch.inference_mode():
        served = jagged.jagged_self_attention(**inputs)
    weights = torch.ones(inputs["q"].shape)
    (ref_out, ref_grads), (out, grads) = (run_self(m, inputs, weights) for m in (reference, jagged))
    assert_close(served, ref_out, **FP32, what="inference output")
    assert_close(out, ref_out, **FP32, what="output")
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert_close(grad, ref_grad, **FP32, what="grad")


# ---------------------------------------------------------------------------------------------- errors, dispatch
def test_bad_inputs_raise_clear_errors():
    inputs = self_inputs([2, 3], 2, 4, False, None, None, torch.float32, 0)
    with pytest.raises(ValueError, match="end at the number of rows of q \\(5\\)"):
        jagged.jagged_self_attention(**(inputs | dict(offsets=offsets_of([2, 2]))))
    with pytest.raises(ValueError, match="never decrease"):
        jagged.jagged_self_attention(**(inputs | dict(offsets=torch.tensor([0, 4, 3, 5]))))
    with pytest.raises(ValueError, match="time_bias needs timestamps"):
        jagged.jagged_self_attention(**(inputs | dict(time_bias=torch.zeros(2, 4))))
    with pytest.raises(ValueError, match="pos_bias must be"):
        jagged.jagged_self_attention(**(inputs | dict(pos_bias=torch.zeros(3, 5))))
    with pytest.raises(ValueError, match="q and k must share \\(heads, head_dim\\)"):
        jagged.jagged_self_attention(**(inputs | dict(k=torch.zeros(5, 2, 8))))
    cross = cross_inputs([1, 2], [3, 4], 2, 4, torch.float32, 0)
    with pytest.raises(ValueError, match="same number of sequences, got 2 and 3"):
        jagged.jagged_cross_attention(**(cross | dict(kv_offsets=offsets_of([3, 4, 0]))))


def test_dispatcher_auto_picks_jagged_on_cpu():
    assert dispatch.resolve("auto", torch.device("cpu")) == "jagged"
    inputs = self_inputs([3, 0, 5], 2, 4, True, 2, 3, torch.float32, 0)
    direct = jagged.jagged_self_attention(**inputs)
    rest = {key: value for key, value in inputs.items() if key not in ("q", "k", "v", "offsets")}
    via_auto = dispatch.jagged_self_attention(
        inputs["q"], inputs["k"], inputs["v"], inputs["offsets"], **rest
    )
    assert torch.equal(via_auto, direct)
