"""The Triton attention kernels against the PyTorch reference, forward and backward.

Triton reads ``TRITON_INTERPRET`` when it is imported, and any other test of the same pytest process may have
imported it first. So the tests that pytest collects here (the *launchers*) only start a fresh interpreter:
``python -m pytest`` on this same file with ``TRITON_INTERPRET=1`` and ``GEMFLOW_TRITON_KERNEL_TESTS=1`` set,
in which the *kernel tests* below are defined and run on CPU tensors. With ``GEMFLOW_TRITON_DEVICE=cuda`` (the
``gpu`` launcher) the same kernel tests run compiled on a GPU instead. The *compile tests* need no GPU either:
Triton compiles the real kernels for Hopper (sm_90) here and ptxas checks that they fit the chip.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNEL_TESTS = os.environ.get("GEMFLOW_TRITON_KERNEL_TESTS") == "1"
REPO_ROOT = Path(__file__).resolve().parents[3]

if importlib.util.find_spec("triton") is None:
    pytestmark = pytest.mark.skip(
        reason="triton is not installed (pip install triton) - kernels not testable here"
    )


if not KERNEL_TESTS:

    def _run_kernel_tests(selection: str, *, device: str = "cpu", timeout_s: int = 600) -> None:
        env = {**os.environ, "GEMFLOW_TRITON_KERNEL_TESTS": "1", "GEMFLOW_TRITON_DEVICE": device}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        else:
            env.pop("TRITON_INTERPRET", None)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(Path(__file__)),
            "-k",
            selection,
        ]
        proc = subprocess.run(
            cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        report = f"$ {' '.join(cmd)}\n{proc.stdout[-20000:]}\n{proc.stderr[-5000:]}"
        assert proc.returncode == 0, f"kernel tests failed (exit {proc.returncode}):\n{report}"
        assert " passed" in proc.stdout, f"no kernel test ran:\n{report}"

    def test_kernels_match_reference_on_fixed_cases():
        _run_kernel_tests("case_")

    @pytest.mark.integration
    def test_kernels_match_reference_on_random_jagged_batches():
        _run_kernel_tests("prop_")

    @pytest.mark.integration
    def test_kernels_compile_for_hopper():
        _run_kernel_tests("compile_", device="compile")

    @pytest.mark.gpu
    def test_kernels_compiled_on_cuda():
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device: the compiled kernels are checked on a GPU machine only")
        _run_kernel_tests("case_ or prop_", device="cuda")

else:
    import inspect

    import torch
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    from models.attention import dispatch, reference, triton_kernels, triton_launch
    from models.attention import triton as tri

    # "compile" runs only the compile tests: real (not interpreted) Triton, CPU tensors for nothing else.
    MODE = os.environ.get("GEMFLOW_TRITON_DEVICE", "cpu")
    DEVICE = torch.device("cpu" if MODE == "compile" else MODE)
    # Max error relative to the reference's largest magnitude. Tight for fp32 (IEEE dots on both sides); bf16
    # rounds P, dS and O before their matmuls as flash kernels do (measured up to ~1.5e-2 at these shapes).
    TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2}
    PROPERTY_SETTINGS = settings(
        max_examples=40,
        deadline=None,
        derandomize=True,  # CI sees the same examples every run
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )

    def _offsets(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], device=DEVICE)

    def _timestamps(lengths: list[int], gen: torch.Generator, dtype=torch.int64) -> torch.Tensor:
        """Sorted per sequence, gaps from seconds to months so that many log2 time buckets are hit."""
        parts = []
        for n in lengths:
            scale = 2 ** torch.randint(0, 24, (n,), generator=gen)
            gaps = (torch.rand(n, generator=gen) * scale).long()
            parts.append(1_700_000_000 + gaps.cumsum(0))
        ts = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        return ts.to(dtype).to(DEVICE)

    def _randn(shape, dtype, gen) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype=dtype, device=DEVICE).requires_grad_()

    def _assert_close(
        name: str, got: torch.Tensor | None, want: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        assert (got is None) == (want is None), f"{name}: one side has no gradient"
        if got is None:
            return
        assert got.shape == want.shape and got.dtype == want.dtype, (
            f"{name}: {got.shape}/{got.dtype} vs {want.shape}"
        )
        assert torch.isfinite(got).all(), f"{name}: non-finite values"
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        scale = max(1.0, want.float().abs().max().item() if want.numel() else 0.0)
        assert err <= TOLERANCE[dtype] * scale, (
            f"{name}: max error {err:.3g} above {TOLERANCE[dtype]} x {scale:.3g}"
        )

    def _check_against_reference(run, leaves: dict[str, torch.Tensor], dtype: torch.dtype, gen) -> None:
        """Runs ``run(module)`` with both backends; compares outputs and the gradients of every leaf."""
        results = {}
        for name, module in (("reference", reference), ("triton", tri)):
            out = run(module)
            grad_out = torch.randn(out.shape, generator=gen).to(out)
            wanted = {k: t for k, t in leaves.items() if t.requires_grad}
            if out.requires_grad:
                grads = torch.autograd.grad(out, list(wanted.values()), grad_out, allow_unused=True)
            else:  # the reference returns constant zeros when nothing attends (empty batch / no keys anywhere)
                grads = [torch.zeros_like(t) for t in wanted.values()]
            results[name] = (out.detach(), dict(zip(wanted, grads, strict=True)))
            gen.manual_seed(gen.initial_seed())  # same grad_out for both backends
        (ref_out, ref_grads), (tri_out, tri_grads) = results["reference"], results["triton"]
        _assert_close("output", tri_out, ref_out, dtype)
        for name in ref_grads:
            _assert_close(f"d{name}", tri_grads[name], ref_grads[name], dtype)

    def _self_case(
        lengths,
        heads,
        head_dim,
        dtype,
        causal,
        max_rel,
        time_buckets,
        seed,
        ts_dtype=torch.int64,
        timestamps=None,
    ):
        gen = torch.Generator().manual_seed(seed)
        total = sum(lengths)
        leaves = {n: _randn((total, heads, head_dim), dtype, gen) for n in ("q", "k", "v")}
        kwargs = {}
        if max_rel is not None:
            leaves["pos_bias"] = kwargs["pos_bias"] = _randn((heads, 2 * max_rel + 1), torch.float32, gen)
        if time_buckets is not None:
            leaves["time_bias"] = kwargs["time_bias"] = _randn((heads, time_buckets), torch.float32, gen)
            ts = _timestamps(lengths, gen, ts_dtype) if timestamps is None else timestamps.to(DEVICE)
            kwargs["timestamps"] = ts
        offsets = _offsets(lengths)
        gen = torch.Generator().manual_seed(seed + 1)

        def run(module):
            return module.jagged_self_attention(
                leaves["q"], leaves["k"], leaves["v"], offsets, causal=causal, **kwargs
            )

        _check_against_reference(run, leaves, dtype, gen)

    def _cross_case(q_lengths, kv_lengths, heads, head_dim, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        leaves = {"q": _randn((sum(q_lengths), heads, head_dim), dtype, gen)}
        leaves |= {n: _randn((sum(kv_lengths), heads, head_dim), dtype, gen) for n in ("k", "v")}
        q_offsets, kv_offsets = _offsets(q_lengths), _offsets(kv_lengths)
        gen = torch.Generator().manual_seed(seed + 1)

        def run(module):
            return module.jagged_cross_attention(leaves["q"], q_offsets, leaves["k"], leaves["v"], kv_offsets)

        _check_against_reference(run, leaves, dtype, gen)

    def test_case_runs_in_the_intended_mode():
        interpreted = triton_launch.interpreting()
        assert interpreted == (DEVICE.type == "cpu"), "TRITON_INTERPRET must be set exactly for CPU runs"
        assert type(triton_kernels.fwd_kernel).__name__ == (
            "InterpretedFunction" if interpreted else "JITFunction"
        )

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("causal", [False, True])
    def test_case_self_attention_with_both_biases(dtype, causal):
        _self_case(
            [0, 1, 17, 40, 5],
            heads=2,
            head_dim=32,
            dtype=dtype,
            causal=causal,
            max_rel=6,
            time_buckets=12,
            seed=3,
        )

    @pytest.mark.parametrize("head_dim", [24, 64])
    def test_case_head_dims_masked_and_wide(head_dim):
        _self_case(
            [9, 33],
            heads=1,
            head_dim=head_dim,
            dtype=torch.float32,
            causal=True,
            max_rel=None,
            time_buckets=None,
            seed=head_dim,
        )

    @pytest.mark.parametrize("ts_dtype", [torch.float64, torch.float32, torch.int32])
    def test_case_time_bias_from_float_and_narrow_timestamps(ts_dtype):
        _self_case(
            [20, 3],
            heads=2,
            head_dim=16,
            dtype=torch.float32,
            causal=False,
            max_rel=None,
            time_buckets=30,
            seed=11,
            ts_dtype=ts_dtype,
        )

    def test_case_time_buckets_exact_at_powers_of_two():
        # Gaps of 2**k - 2, 2**k - 1 and 2**k seconds sit on both sides of bucket edges (1 + |dt| = 2**k); a
        # bucket off by one moves the output and the table gradient far beyond fp32 tolerance.
        gaps = [0, 1, 1, 2, 3, 6, 7, 8, 2**20 - 2, 1, 1, 2**30 - 2, 1, 1, 2**33 - 1, 1]
        ts = torch.tensor(gaps, dtype=torch.int64).cumsum(0) + 1_700_000_000
        _self_case(
            [len(gaps)],
            heads=2,
            head_dim=16,
            dtype=torch.float32,
            causal=False,
            max_rel=None,
            time_buckets=40,
            seed=4,
            timestamps=ts,
        )

    def test_case_bias_tables_without_gradients():
        gen = torch.Generator().manual_seed(5)
        lengths = [7, 0, 12]
        q, k, v = (_randn((19, 2, 16), torch.float32, gen) for _ in range(3))
        pos = torch.randn(2, 5, generator=gen).to(DEVICE)  # no requires_grad: the kernel skips its histogram
        offsets = _offsets(lengths)
        out = tri.jagged_self_attention(q, k, v, offsets, causal=True, pos_bias=pos)
        want = reference.jagged_self_attention(q, k, v, offsets, causal=True, pos_bias=pos)
        _assert_close("output", out, want, torch.float32)
        out.sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()

    def test_case_cross_attention_candidates_against_users_with_empty_key_sets():
        _cross_case([3, 0, 7, 1, 2], [0, 20, 25, 1, 0], heads=2, head_dim=32, dtype=torch.float32, seed=7)
        _cross_case(
            [70], [30], heads=2, head_dim=32, dtype=torch.bfloat16, seed=8
        )  # many candidates, one user

    def test_case_empty_batches():
        for lengths in ([], [0], [0, 0, 0]):
            _self_case(
                lengths,
                heads=2,
                head_dim=16,
                dtype=torch.float32,
                causal=True,
                max_rel=2,
                time_buckets=4,
                seed=1,
            )
        gen = torch.Generator().manual_seed(0)
        q = _randn((4, 1, 16), torch.float32, gen)
        empty = torch.zeros(0, 1, 16, device=DEVICE)
        out = tri.jagged_cross_attention(q, _offsets([4]), empty, empty, _offsets([0]))
        assert out.shape == q.shape and not out.any()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("mode", ["causal", "bidirectional", "cross"])
    def test_case_empty_and_length_one_sequences(dtype, mode):
        """Forward and backward on the edge lengths, in every mode and dtype the models use."""
        for lengths in ([0], [1], [0, 1, 0, 1], [1, 0, 3]):
            seed = len(lengths)
            if mode == "cross":  # the reversed lengths give queries without keys and keys without queries
                _cross_case(lengths, lengths[::-1], heads=2, head_dim=16, dtype=dtype, seed=seed)
            else:
                _self_case(
                    lengths, heads=2, head_dim=16, dtype=dtype, causal=mode == "causal", max_rel=2,
                    time_buckets=4, seed=seed,
                )  # fmt: skip

    def test_case_strided_qkv_from_one_projection_and_int32_offsets():
        gen = torch.Generator().manual_seed(9)
        qkv = torch.randn(30, 3, 2, 32, generator=gen).to(DEVICE).requires_grad_()
        q, k, v = qkv.unbind(1)  # row stride 3 * H * D: the kernels read it in place
        offsets = _offsets([10, 20]).to(torch.int32)
        out = tri.jagged_self_attention(q, k, v, offsets, causal=True)
        (g_tri,) = torch.autograd.grad(out.square().sum(), [qkv])
        want = reference.jagged_self_attention(q, k, v, offsets.long(), causal=True)
        (g_ref,) = torch.autograd.grad(want.square().sum(), [qkv])
        _assert_close("output", out, want, torch.float32)
        _assert_close("dqkv", g_tri, g_ref, torch.float32)

    def test_case_dispatcher_routes_to_triton():
        gen = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(6, 1, 16, generator=gen).to(DEVICE) for _ in range(3))
        offsets = _offsets([2, 4])
        got = dispatch.jagged_self_attention(q, k, v, offsets, backend="triton", causal=True)
        want = reference.jagged_self_attention(q, k, v, offsets, causal=True)
        _assert_close("output", got, want, torch.float32)

    def test_case_bad_inputs_raise_clear_errors(monkeypatch):
        q = torch.randn(5, 2, 16, device=DEVICE)
        with pytest.raises(ValueError, match="end at the number of rows"):
            tri.jagged_self_attention(q, q, q, torch.tensor([0, 3, 4], device=DEVICE))
        with pytest.raises(ValueError, match="never decrease"):
            tri.jagged_self_attention(q, q, q, torch.tensor([0, 4, 2, 5], device=DEVICE))
        with pytest.raises(ValueError, match="int32 or int64"):
            tri.jagged_self_attention(q, q, q, torch.tensor([0.0, 5.0], device=DEVICE))
        with pytest.raises(ValueError, match="share dtype"):
            tri.jagged_self_attention(q, q.bfloat16(), q, torch.tensor([0, 5], device=DEVICE))
        with pytest.raises(ValueError, match="dtype torch.float64"):
            tri.jagged_self_attention(q.double(), q.double(), q.double(), torch.tensor([0, 5], device=DEVICE))
        with pytest.raises(ValueError, match="time_bias needs timestamps"):
            tri.jagged_self_attention(
                q, q, q, torch.tensor([0, 5], device=DEVICE), time_bias=torch.zeros(2, 4)
            )
        with pytest.raises(ValueError, match="odd number of columns"):
            tri.jagged_self_attention(
                q, q, q, torch.tensor([0, 5], device=DEVICE), pos_bias=torch.zeros(2, 4)
            )
        with pytest.raises(ValueError, match="same number of sequences"):
            tri.jagged_cross_attention(q, torch.tensor([0, 5], device=DEVICE), q, q, torch.tensor([0, 2, 5]))
        if DEVICE.type == "cpu":
            monkeypatch.setenv("TRITON_INTERPRET", "0")
            with pytest.raises(ValueError, match="needs CUDA tensors"):
                tri.jagged_self_attention(q, q, q, torch.tensor([0, 5]))

    # -------------------------------------------------------------------------- properties (random batches)

    LENGTHS = st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, 40)), min_size=1, max_size=4)

    def edge_examples(test):
        """Empty and length-1 sequences in every mode and dtype, always tried before the random batches."""
        for lengths in ([0, 1], [1]):
            for dtype in (torch.float32, torch.bfloat16):
                for causal in (False, True):
                    test = example(
                        lengths=lengths, heads=2, head_dim=16, dtype=dtype, causal=causal,
                        max_rel=3, time_buckets=5, seed=1,
                    )(test)  # fmt: skip
        return test

    @PROPERTY_SETTINGS
    @edge_examples
    @given(
        lengths=LENGTHS,
        heads=st.integers(1, 2),
        head_dim=st.sampled_from([16, 32]),
        dtype=st.sampled_from([torch.float32, torch.bfloat16]),
        causal=st.booleans(),
        max_rel=st.one_of(st.none(), st.integers(0, 20)),
        time_buckets=st.one_of(st.none(), st.integers(1, 24)),
        seed=st.integers(0, 2**16),
    )
    def test_prop_self_attention_matches_reference(
        lengths, heads, head_dim, dtype, causal, max_rel, time_buckets, seed
    ):
        _self_case(lengths, heads, head_dim, dtype, causal, max_rel, time_buckets, seed)

    @PROPERTY_SETTINGS
    @example(pairs=[(0, 0), (1, 1), (1, 0), (0, 1)], heads=2, head_dim=16, dtype=torch.float32, seed=2)
    @example(pairs=[(0, 0), (1, 1), (1, 0), (0, 1)], heads=2, head_dim=16, dtype=torch.bfloat16, seed=2)
    @given(
        pairs=st.lists(
            st.tuples(
                st.one_of(st.sampled_from([0, 1]), st.integers(0, 12)),
                st.one_of(st.just(0), st.integers(0, 40)),
            ),
            min_size=1,
            max_size=4,
        ),
        heads=st.integers(1, 2),
        head_dim=st.sampled_from([16, 32]),
        dtype=st.sampled_from([torch.float32, torch.bfloat16]),
        seed=st.integers(0, 2**16),
    )
    def test_prop_cross_attention_matches_reference(pairs, heads, head_dim, dtype, seed):
        _cross_case([p[0] for p in pairs], [p[1] for p in pairs], heads, head_dim, dtype, seed)

    # -------------------------------------------------------------------------- compiled for sm_90, no GPU needed

    HOPPER_SHARED_MEMORY = 232448  # bytes of shared memory one block may opt into on sm_90
    _POINTER_TYPES = {
        "OUT32": "*fp32", "LSE": "*fp32", "DELTA": "*fp32", "DPOS": "*fp32", "DTIME": "*fp32",
        "pos_bias": "*fp32", "time_bias": "*fp32", "ts": "*i64",
        "q_offsets": "*i64", "kv_offsets": "*i64", "sched_seq": "*i32", "sched_start": "*i32",
    }  # fmt: skip

    def _signature(kernel, value_type: str, constexprs: dict) -> dict[str, str]:
        """Argument types as the launchers pass them: value tensors, fp32 side buffers, int sizes/strides."""
        sig = {}
        for name in inspect.signature(kernel.fn).parameters:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name in ("Q", "K", "V", "OUT", "DO", "DK", "DV", "DQ"):
                sig[name] = value_type
            elif name == "sm_scale":
                sig[name] = "fp32"
            else:
                sig[name] = _POINTER_TYPES.get(name, "i32")
        return sig

    @pytest.mark.parametrize(
        ("dtype", "head_dim"),
        [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 32), (torch.float32, 64)],
    )
    def test_compile_all_kernels_fit_hopper(dtype, head_dim):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        value_type = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
        cfgs = triton_launch.block_configs(head_dim, dtype, torch.device("cuda"))
        flags = dict(CAUSAL=True, HAS_POS=True, HAS_TIME=True, BLOCK_D=head_dim, UPCAST=False,
                     PRECISION=triton_launch.dot_precision(dtype)[0])  # fmt: skip
        kernels = [
            (triton_kernels.fwd_kernel, cfgs["fwd"], dict(STORE_OUT32=True)),
            (triton_kernels.bwd_dkdv_kernel, cfgs["dkdv"], {}),
            (
                triton_kernels.bwd_dq_kernel,
                cfgs["dq"],
                dict(POS_GRAD=True, TIME_GRAD=True, POS_BINS=64, TIME_BINS=32),
            ),
        ]
        for kernel, cfg, extra in kernels:
            constexprs = dict(flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **extra)
            compiled = triton.compile(
                ASTSource(
                    fn=kernel, signature=_signature(kernel, value_type, constexprs), constexprs=constexprs
                ),
                target=GPUTarget("cuda", 90, 32),
                options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            )
            assert compiled.asm["cubin"], f"{kernel.fn.__name__}: no cubin"
            shared = compiled.metadata.shared
            assert shared <= HOPPER_SHARED_MEMORY, (
                f"{kernel.fn.__name__}: {shared} B of shared memory > sm_90's"
            )
