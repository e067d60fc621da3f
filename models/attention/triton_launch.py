"""Host side of the Triton attention kernels: tile configs, the block schedule, and the kernel launches.

``forward`` / ``backward`` allocate the outputs, build the flattened heaviest-first block schedule of the
jagged batch, and launch ``models.attention.triton_kernels``; the autograd Function and the checked entry
points are in ``models.attention.triton``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from models.attention.triton_kernels import bwd_dkdv_kernel, bwd_dq_kernel, fwd_kernel


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch settings of one kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def block_configs(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, BlockConfig]:
    """Tiles per kernel. Chosen by compiling for sm_90 (ptxas resource usage; see the compile tests): 8 warps
    keep the score tile plus the in-kernel bias math in registers (4 warps spill), and fp32 tiles are halved
    so that the pipelined K/V buffers fit Hopper's 227 KB of shared memory.
    """
    if device.type != "cuda":  # the interpreter: smallest legal tiles keep it fast
        small = BlockConfig(16, 16, 1, 1)
        return {"fwd": small, "dkdv": small, "dq": small}
    if dtype == torch.float32:
        return {
            "fwd": BlockConfig(64, 32, 4, 2),
            "dkdv": BlockConfig(32, 32, 4, 2),
            "dq": BlockConfig(32, 32, 4, 2),
        }
    return {
        "fwd": BlockConfig(128, 64, 8, 3 if head_dim <= 64 else 2),
        "dkdv": BlockConfig(64, 64, 8, 2),
        "dq": BlockConfig(64, 64, 8, 2),
    }


def _schedule(
    lengths: torch.Tensor,
    block: int,
    work: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
):
    """Flattened list of (sequence, local start) blocks covering every sequence, heaviest first.

    ``work`` gives each block's cost (defaults to equal); sorting heaviest-first shortens the tail when
    lengths are skewed. Returns (seq int32, start int32, count) with one host sync for the count.
    """
    n_blocks = (lengths + block - 1) // block
    count = int(n_blocks.sum())
    if count == 0:
        return None, None, 0
    seq = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), n_blocks, output_size=count
    )
    first = torch.cumsum(n_blocks, 0) - n_blocks
    start = (torch.arange(count, device=lengths.device) - first[seq]) * block
    if work is not None:
        order = torch.argsort(work(seq, start), descending=True, stable=True)
        seq, start = seq[order], start[order]
    return seq.to(torch.int32).contiguous(), start.to(torch.int32).contiguous(), count


def _keys_scanned(kv_lens: torch.Tensor, block_m: int, causal: bool):
    def work(seq: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return torch.minimum(kv_lens[seq], start + block_m) if causal else kv_lens[seq]

    return work


def _queries_scanned(q_lens: torch.Tensor, causal: bool):
    def work(seq: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return q_lens[seq] - start if causal else q_lens[seq]

    return work


def dot_precision(dtype: torch.dtype) -> tuple[str, bool]:
    """(tl.dot input precision, upcast half tiles to fp32): fp32 stays IEEE-exact for tight comparisons."""
    return ("ieee" if dtype == torch.float32 else "tf32"), (interpreting() and dtype == torch.bfloat16)


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any row/head strides (e.g. q, k, v split from one qkv projection) but unit d-stride."""
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass
class Bias:
    """Relative-bias inputs of self-attention, validated; dummies stand in for absent tables."""

    pos: torch.Tensor | None
    time: torch.Tensor | None
    ts: torch.Tensor | None

    @property
    def max_rel(self) -> int:
        return (self.pos.shape[1] - 1) // 2 if self.pos is not None else 0

    @property
    def num_time_buckets(self) -> int:
        return self.time.shape[1] if self.time is not None else 1

    def args(self, dummy: torch.Tensor) -> tuple:
        pos = self.pos if self.pos is not None else dummy
        time = self.time if self.time is not None else dummy
        ts = self.ts if self.ts is not None else dummy
        return (
            pos,
            time,
            ts,
            pos.stride(0) if self.pos is not None else 0,
            time.stride(0) if self.time is not None else 0,
            self.max_rel,
            self.num_time_buckets,
        )


def bias_inputs(pos_bias, time_bias, timestamps) -> Bias:
    """The (already validated) bias inputs, contiguous, timestamps in a type wide enough to difference."""
    ts = None
    if time_bias is not None:
        if timestamps.dtype in (torch.int64, torch.float32, torch.float64):
            ts = timestamps.contiguous()
        else:  # narrow types: difference them in a wide type so that nothing overflows
            ts = timestamps.to(torch.float64 if timestamps.is_floating_point() else torch.int64).contiguous()
    return Bias(
        pos=pos_bias.contiguous() if pos_bias is not None else None,
        time=time_bias.contiguous() if time_bias is not None else None,
        ts=ts,
    )


def forward(q, k, v, q_offsets, kv_offsets, causal: bool, bias: Bias, keep_fp32_out: bool):
    """(out, lse, out32): out32 is an fp32 copy of out when asked for and out is not fp32 already."""
    total_q, heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.zeros((total_q, heads), dtype=torch.float32, device=q.device)
    store_out32 = keep_fp32_out and q.dtype != torch.float32
    out32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if store_out32 else out
    cfg = block_configs(head_dim, q.dtype, q.device)["fwd"]
    q_lens = q_offsets[1:] - q_offsets[:-1]
    kv_lens = kv_offsets[1:] - kv_offsets[:-1]
    seq, start, count = _schedule(q_lens, cfg.block_m, _keys_scanned(kv_lens, cfg.block_m, causal))
    if count == 0:
        return out, lse, out32
    precision, upcast = dot_precision(q.dtype)
    fwd_kernel[(count * heads,)](
        q,
        k,
        v,
        out,
        out32,
        lse,
        q_offsets,
        kv_offsets,
        seq,
        start,
        *bias.args(lse)[:3],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        *bias.args(lse)[3:],
        heads,
        head_dim,
        1.0 / math.sqrt(head_dim),
        CAUSAL=causal,
        HAS_POS=bias.pos is not None,
        HAS_TIME=bias.time is not None,
        STORE_OUT32=store_out32,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION=precision,
        UPCAST=upcast,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, lse, out32


def backward(
    do, q, k, v, out, lse, q_offsets, kv_offsets, causal: bool, bias: Bias, pos_grad: bool, time_grad: bool
):
    total_q, heads, head_dim = q.shape
    do = rows_contiguous(do)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    dpos = torch.zeros(bias.pos.shape, dtype=torch.float32, device=q.device) if pos_grad else None
    dtime = torch.zeros(bias.time.shape, dtype=torch.float32, device=q.device) if time_grad else None
    if total_q == 0 or k.shape[0] == 0:
        return dq.zero_(), dk, dv, dpos, dtime
    delta = (do.float() * out.float()).sum(-1).contiguous()  # (total_q, H): rowsum(dO * O)
    cfgs = block_configs(head_dim, q.dtype, q.device)
    q_lens = q_offsets[1:] - q_offsets[:-1]
    kv_lens = kv_offsets[1:] - kv_offsets[:-1]
    precision, upcast = dot_precision(q.dtype)
    block_d = max(16, triton.next_power_of_2(head_dim))
    common = dict(
        CAUSAL=causal,
        HAS_POS=bias.pos is not None,
        HAS_TIME=bias.time is not None,
        BLOCK_D=block_d,
        PRECISION=precision,
        UPCAST=upcast,
    )
    bias_args = bias.args(lse)
    qkv_strides = (
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        do.stride(0),
        do.stride(1),
    )
    scale = 1.0 / math.sqrt(head_dim)

    cfg = cfgs["dkdv"]
    seq, start, count = _schedule(kv_lens, cfg.block_n, _queries_scanned(q_lens, causal))
    if count:
        bwd_dkdv_kernel[(count * heads,)](
            q,
            k,
            v,
            do,
            dk,
            dv,
            lse,
            delta,
            q_offsets,
            kv_offsets,
            seq,
            start,
            *bias_args[:3],
            *qkv_strides,
            dk.stride(0),
            dk.stride(1),
            dv.stride(0),
            dv.stride(1),
            *bias_args[3:],
            heads,
            head_dim,
            scale,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **common,
        )

    cfg = cfgs["dq"]
    seq, start, count = _schedule(q_lens, cfg.block_m, _keys_scanned(kv_lens, cfg.block_m, causal))
    if count:
        bwd_dq_kernel[(count * heads,)](
            q,
            k,
            v,
            do,
            dq,
            lse,
            delta,
            q_offsets,
            kv_offsets,
            seq,
            start,
            *bias_args[:3],
            dpos if pos_grad else lse,
            dtime if time_grad else lse,
            *qkv_strides,
            dq.stride(0),
            dq.stride(1),
            *bias_args[3:],
            heads,
            head_dim,
            scale,
            POS_GRAD=pos_grad,
            TIME_GRAD=time_grad,
            POS_BINS=triton.next_power_of_2(2 * bias.max_rel + 1),
            TIME_BINS=triton.next_power_of_2(bias.num_time_buckets),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **common,
        )
    else:
        dq.zero_()
    return dq, dk, dv, dpos, dtime
