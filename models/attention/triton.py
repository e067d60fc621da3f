"""The Triton attention backend's entry points (the GPU fast path behind ``models.attention.dispatch``).

Same contract as ``models.attention.reference``: values (total, H, D) + offsets (B + 1,), never a padded copy.
Here: the backend's input checks and the autograd Function over the kernels. The kernels themselves are in
``models.attention.triton_kernels``, their tile configs, block schedule and launches in
``models.attention.triton_launch``.

Works on torch 2.11 + Triton 3.6 and newer; only long-standing Triton APIs are used (checked: torch 2.11.0 +
Triton 3.6.0 and torch 2.13.0 + Triton 3.9.0 pass the interpreter-mode tests and compile for sm_90). On a CPU it
runs under ``TRITON_INTERPRET=1`` (set before Triton is imported), which is how the tests check it. Triton 3.6's
interpreter needs NumPy < 2.4: it turns loop bounds into ints with ``int()`` on one-element arrays, which NumPy
2.4 refuses (Triton 3.9 squeezes them first); compiled GPU runs never take that path.
"""

from __future__ import annotations

import torch

from models.attention import validate
from models.attention.triton_launch import Bias, backward, bias_inputs, forward, interpreting, rows_contiguous

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256


def _check_backend(q: torch.Tensor) -> None:
    """What this backend adds to the shared checks (``models.attention.validate``): device, dtype, head size."""
    if not interpreting() and q.device.type != "cuda":
        raise ValueError(
            "the triton attention backend needs CUDA tensors (set TRITON_INTERPRET=1 before importing triton "
            f"to interpret the kernels on a CPU); got tensors on {q.device}"
        )
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; the triton backend supports {_SUPPORTED_DTYPES}")
    if q.shape[2] > _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {q.shape[2]} is above the supported maximum of {_MAX_HEAD_DIM}")


class _JaggedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, causal, pos_bias, time_bias, ts):
        bias = Bias(pos_bias, time_bias, ts)
        # The bias-table gradients are sums of dS = P * (dP - delta) over many entries, and each row of dS sums
        # to zero: delta = rowsum(dO * O) taken from a bf16-rounded O leaves a bias that those sums pile up.
        # So when a table needs its gradient, backward gets delta from an fp32 copy of O.
        exact_delta = any(t is not None and t.requires_grad for t in (pos_bias, time_bias))
        if q.shape[0] == 0 or k.shape[0] == 0:  # nothing to attend: zeros, like the reference
            out = torch.zeros_like(q, memory_format=torch.contiguous_format)
            lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
            out_for_delta = out
        else:
            out, lse, out_for_delta = forward(q, k, v, q_offsets, kv_offsets, causal, bias, exact_delta)
        ctx.save_for_backward(q, k, v, out_for_delta, lse, q_offsets, kv_offsets, pos_bias, time_bias, ts)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, q_offsets, kv_offsets, pos_bias, time_bias, ts = ctx.saved_tensors
        bias = Bias(pos_bias, time_bias, ts)
        pos_grad = pos_bias is not None and ctx.needs_input_grad[6]
        time_grad = time_bias is not None and ctx.needs_input_grad[7]
        dq, dk, dv, dpos, dtime = backward(
            do, q, k, v, out, lse, q_offsets, kv_offsets, ctx.causal, bias, pos_grad, time_grad
        )
        return (
            dq,
            dk,
            dv,
            None,
            None,
            None,
            dpos.to(pos_bias.dtype) if pos_grad else None,
            dtime.to(time_bias.dtype) if time_grad else None,
            None,
        )


def jagged_self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    causal: bool = False,
    pos_bias: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention within each jagged sequence. q, k, v: (total, H, D); timestamps: (total,) seconds."""
    validate.check_self_attention(q, k, v, offsets, pos_bias, time_bias, timestamps)
    _check_backend(q)
    offsets = offsets.to(torch.int64).contiguous()
    bias = bias_inputs(pos_bias, time_bias, timestamps)
    q, k, v = (rows_contiguous(t) for t in (q, k, v))
    return _JaggedAttention.apply(q, k, v, offsets, offsets, bool(causal), bias.pos, bias.time, bias.ts)


def jagged_cross_attention(
    q: torch.Tensor,
    q_offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
) -> torch.Tensor:
    """Each sequence's queries attend over that sequence's keys. q: (total_q, H, D); k, v: (total_kv, H, D)."""
    validate.check_cross_attention(q, q_offsets, k, v, kv_offsets)
    _check_backend(q)
    q_offsets, kv_offsets = (o.to(torch.int64).contiguous() for o in (q_offsets, kv_offsets))
    q, k, v = (rows_contiguous(t) for t in (q, k, v))
    return _JaggedAttention.apply(q, k, v, q_offsets, kv_offsets, False, None, None, None)
