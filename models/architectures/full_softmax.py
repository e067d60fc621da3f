"""Softmax cross-entropy over the whole catalog, in row chunks, with its gradients computed in the forward pass.

``F.cross_entropy(query @ items.T, targets)`` materialises the (N, V) logits, their softmax and their gradient
(three N x V buffers: ~70 MB each for 1,400 targets x 12,000 Toys items) and walks them again in backward. Here
each chunk of ``chunk`` rows goes logits -> softmax -> (softmax - one-hot) in one reused (chunk, V) buffer that
stays in cache, and both gradients (query: buf @ items; items: buf.T @ query, accumulated) are written right
away; backward only scales them by the incoming gradient. Same value and gradients as the unchunked form (a
test checks both); on Toys it halves the user model's training step (`docs/training-speed.md`).

``gemm_dtype=torch.bfloat16`` runs the GEMMs on bf16 copies of the query and the items (where the CPU has bf16
matmul units, Intel AMX or AVX-512 BF16, they run 3-5x faster than fp32) and keeps the softmax, the loss and
both gradient sums in fp32: the loss moves by ~1e-5 and the gradients by ~0.2% of their norm (a test bounds
both). Whole runs agree on cosine-scored models; with unnormalized dot-product logits (SASRec, Sports d 256)
training learned slower than in fp32 (`docs/training-speed.md`), so it is opt-in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 64  # rows per chunk: 64 x 12k floats = 3 MB, inside L2/L3 on the CPUs we measured
LOW_GROUP = 1024  # bf16: rows per item-gradient GEMM (rounded to whole chunks; 1,024 x 18k bf16 = 37 MB)


class _ChunkedSoftmaxCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, items, targets, chunk, gemm_dtype):
        n = query.shape[0]
        need_query, need_items = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_query = torch.empty_like(query) if need_query else None
        grad_items = torch.zeros_like(items) if need_items else None
        low = gemm_dtype is not None and gemm_dtype != query.dtype
        gemm_query, gemm_items = (query.to(gemm_dtype), items.to(gemm_dtype)) if low else (query, items)
        buffer = query.new_empty(min(chunk, n), items.shape[0])
        # bf16: the softmax gradients of up to LOW_GROUP rows feed one item-gradient GEMM, whose (V, d) result
        # is added to the fp32 sum once per group, not once per chunk (that add moved more bytes than the GEMM)
        group = min(n, max(chunk, LOW_GROUP // chunk * chunk)) if low else chunk
        low_buffer = query.new_empty(group, items.shape[0], dtype=gemm_dtype) if low else buffer
        total = query.new_zeros(())
        for start in range(0, n, chunk):
            q, t = gemm_query[start : start + chunk], targets[start : start + chunk]
            end, at = start + q.shape[0], start % group  # the chunk's rows, and where they sit in the group
            rows = torch.arange(q.shape[0], device=q.device)
            logits, gemm_side = buffer[: q.shape[0]], low_buffer[at : at + q.shape[0]]
            torch.mm(q, gemm_items.T, out=gemm_side)
            if low:
                logits.copy_(gemm_side)
            lse = torch.logsumexp(logits, 1)
            total += (lse - logits[rows, t]).sum()
            logits.sub_(lse[:, None]).exp_()  # the softmax, in place
            logits[rows, t] -= 1.0  # d loss_i / d logits_i (before the 1/n of the mean)
            if not low:
                if need_query:
                    torch.mm(logits, items, out=grad_query[start:end])
                if need_items:
                    grad_items.addmm_(logits.T, q)
                continue
            gemm_side.copy_(logits)
            if need_query:
                grad_query[start:end].copy_(torch.mm(gemm_side, gemm_items))
            if need_items and (at + q.shape[0] == group or end == n):  # the group is full, or the last
                grad_items.add_(
                    torch.mm(low_buffer[: at + q.shape[0]].T, gemm_query[end - at - q.shape[0] : end])
                )
        ctx.n = n
        ctx.save_for_backward(grad_query, grad_items)
        return total / n

    @staticmethod
    def backward(ctx, grad_output):
        grad_query, grad_items = ctx.saved_tensors
        scale = grad_output / ctx.n
        return (
            None if grad_query is None else grad_query * scale,
            None if grad_items is None else grad_items * scale,
            None,
            None,
            None,
        )


def full_softmax_loss(
    query: torch.Tensor,
    items: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
    gemm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of (N, d) ``query`` rows against every row of (V, d) ``items``; ``targets`` (N,).
    ``gemm_dtype``: the training GEMMs' dtype, None = the inputs' (the no-grad path, evaluation, keeps theirs)."""
    if query.shape[0] == 0:
        return (query @ items.T).sum() * 0.0
    if not torch.is_grad_enabled() or not (query.requires_grad or items.requires_grad):
        return F.cross_entropy(query @ items.T, targets)
    return _ChunkedSoftmaxCrossEntropy.apply(query, items.contiguous(), targets, chunk, gemm_dtype)
