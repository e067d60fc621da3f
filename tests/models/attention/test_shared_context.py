"""Attention over one shared context (``models.attention.shared_context``: PyTorch's ops, and gemflow's fused C++
op on both of its paths) against SDPA and a float64 softmax."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from models.attention.shared_context import (
    FusedAttention,
    TorchAttention,
    attend,
    attention_module,
    context_layout,
    reference_attend,
)
from models.inference import native


def _fused(max_bits: int):
    def call(q, keys, values):
        return torch.ops.gemflow.shared_context_attend(q, keys, values, max_bits)

    return call


# the fused op's three paths; "fused_avx512" is the AVX2 one where the CPU has no AVX-512 (or the head dim is 8 / 24)
IMPLEMENTATIONS = {
    "torch_ops": attend,
    "fused_avx512": _fused(512),
    "fused_avx2": _fused(256),
    "fused_portable": _fused(0),
}


@pytest.fixture(scope="module", autouse=True)
def _native_kernels():
    """The C++ op is built on this machine (a compiler is part of it): a failed build is a failure, not a skip."""
    assert native.load(), "gemflow's C++ kernels did not build (see the log above)"


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {
        flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()
    }


def _inputs(n: int, t: int, heads: int, head_dim: int, scale: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads * head_dim, generator=g) * scale
    kv = torch.randn(t, 2, heads, head_dim, generator=g)
    return q, kv


def _float64(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    n, width = q.shape
    k, v = kv.double().unbind(1)
    heads = k.shape[1]
    qh = q.double().view(n, heads, width // heads)
    scores = torch.einsum("nhd,thd->hnt", qh, k) / math.sqrt(k.shape[-1])
    out = torch.einsum("hnt,thd->nhd", torch.softmax(scores, -1), v)
    return out.reshape(n, width)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    ("n", "t", "heads", "head_dim"),
    # the fused op: head dims 8-32 on AVX2 (16 and 32 on AVX-512; others portable), contexts in 1-9 registers of 8
    # (AVX-512: 16) keys or longer (130, 145, 150), row counts that leave a partial tile (AVX2: tiles of 8 / 4 / 3 / 2
    # rows for head dims 8 / 16 / 24 / 32; AVX-512: 8 / 4 rows for 16 / 32)
    [
        (1000, 66, 4, 16),
        (1, 1, 1, 8),
        (7, 3, 2, 32),
        (300, 130, 8, 8),
        (64, 66, 1, 64),
        (5, 8, 2, 16),
        (11, 9, 3, 24),
        (13, 72, 2, 16),
        (6, 73, 4, 8),
        (9, 17, 2, 12),
        (17, 16, 2, 16),
        (9, 17, 3, 32),
        (11, 144, 2, 16),
        (5, 145, 2, 32),
        (3, 150, 1, 16),
    ],  # fmt: skip
)
def test_matches_sdpa_and_float64(impl, n, t, heads, head_dim):
    q, kv = _inputs(n, t, heads, head_dim)
    got = IMPLEMENTATIONS[impl](q, *context_layout(kv))
    torch.testing.assert_close(got, reference_attend(q, kv), rtol=0, atol=2e-6)
    torch.testing.assert_close(got.double(), _float64(q, kv), rtol=0, atol=2e-6)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_large_scores_stay_finite(impl):
    """Scores of hundreds (exp would overflow float32 without the max shift) still give the softmax, as close
    to float64 as SDPA is (float32 scores of ~1,000 carry ~1e-4 rounding, in both)."""
    q, kv = _inputs(200, 40, 4, 16, scale=300.0)
    got = IMPLEMENTATIONS[impl](q, *context_layout(kv))
    assert torch.isfinite(got).all()
    exact = _float64(q, kv)
    sdpa_error = (reference_attend(q, kv).double() - exact).abs().max()
    assert (got.double() - exact).abs().max() <= 1.5 * sdpa_error


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_empty_context_reads_zeros(impl):
    q, kv = _inputs(5, 0, 2, 8)
    assert torch.equal(IMPLEMENTATIONS[impl](q, *context_layout(kv)), torch.zeros(5, 16))
    assert torch.equal(reference_attend(q, kv), torch.zeros(5, 16))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_non_contiguous_queries(impl):
    q, kv = _inputs(50, 10, 2, 8)
    wide = torch.cat([q, q], 1)[:, :16]  # a strided view
    assert not wide.is_contiguous()
    got = IMPLEMENTATIONS[impl](wide, *context_layout(kv))
    torch.testing.assert_close(got, reference_attend(q, kv), rtol=0, atol=2e-6)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_rows_beyond_exp2_range_take_the_shifted_path(impl, sign):
    """Row 3's scores all sit near +-230 (log2 units): unshifted, exp2 overflows or underflows for the whole row.
    It is recomputed with the max subtracted; every row matches float64."""
    q, kv = _inputs(20, 12, 2, 8)
    kv[:, 0, :, 0] += 3.0  # every key leans on channel 0 of each head ...
    q[3, [0, 8]] = sign * 150.0  # ... so row 3's scores are ~ +-150 * 3 / sqrt(8) (x log2 e) for every key
    got = IMPLEMENTATIONS[impl](q, *context_layout(kv))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _float64(q, kv), rtol=0, atol=1e-4)
    torch.testing.assert_close(got, reference_attend(q, kv), rtol=0, atol=1e-4)


def test_scripted_matches_eager():
    scripted = torch.jit.script(attend)
    for shift in (0.0, 300.0):
        q, kv = _inputs(100, 20, 4, 8, scale=1.0 + shift)
        torch.testing.assert_close(
            scripted(q, *context_layout(kv)), attend(q, *context_layout(kv)), rtol=0, atol=0
        )


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_nan_query_gives_nan_as_pytorch_does(impl):
    """A broken input is not hidden: the NaN row's head reads NaN, as SDPA's does; other rows are untouched."""
    q, kv = _inputs(9, 20, 2, 16)
    q[4, 3] = float("nan")
    got, ref = IMPLEMENTATIONS[impl](q, *context_layout(kv)), reference_attend(q, kv)
    assert torch.equal(got.isnan(), ref.isnan()) and got[4, :16].isnan().all()
    keep = torch.arange(9) != 4
    torch.testing.assert_close(got[keep], ref[keep], rtol=0, atol=2e-6)


def test_fused_op_uses_the_widest_simd_the_cpu_has():
    """No vectorized path is silently lost on the CPUs it is for (AVX-512: head dims 16 and 32; AVX2: 8-32)."""
    bits = torch.ops.gemflow.shared_context_attend_simd_bits
    flags = _cpu_flags()
    avx2 = 256 if {"avx2", "fma"} <= flags else 0
    widest = 512 if "avx512f" in flags else avx2
    assert bits(16) == widest and bits(32) == widest
    assert bits(8) == avx2 and bits(24) == avx2  # no AVX-512 tile for these
    assert bits(16, 256) == avx2 and bits(16, 0) == 0  # the cap the tests use to run every path
    assert bits(12) == 0 and bits(64) == 0


def test_fused_op_on_two_threads_equals_one():
    q, kv = _inputs(1000, 66, 4, 16)
    layout = context_layout(kv)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.gemflow.shared_context_attend(q, *layout)
        torch.set_num_threads(2)
        two = torch.ops.gemflow.shared_context_attend(q, *layout)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_fused_op_names_wrong_inputs():
    q, kv = _inputs(4, 6, 2, 8)
    keys, values = context_layout(kv)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.gemflow.shared_context_attend(q[:, :12], keys, values)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.gemflow.shared_context_attend(q.double(), keys, values)
    with pytest.raises(RuntimeError, match=r"expected q \(N, H\*d\)"):
        torch.ops.gemflow.shared_context_attend(q[None], keys, values)


def test_attention_modules_script_and_agree():
    """The one-user path holds one of these modules and TorchScript compiles it; the default is the fused op."""
    assert isinstance(attention_module(), FusedAttention)
    q, kv = _inputs(100, 20, 4, 8)
    layout = context_layout(kv)
    fused, plain = torch.jit.script(FusedAttention()), torch.jit.script(TorchAttention())
    torch.testing.assert_close(fused(q, *layout), plain(q, *layout), rtol=0, atol=2e-6)


def test_kernels_off_by_environment(monkeypatch):
    monkeypatch.setenv("GEMFLOW_NATIVE_KERNELS", "0")
    native.load.cache_clear()
    try:
        assert not native.load()
        assert isinstance(attention_module(), TorchAttention)
    finally:
        monkeypatch.delenv("GEMFLOW_NATIVE_KERNELS")
        native.load.cache_clear()
        assert native.load()
