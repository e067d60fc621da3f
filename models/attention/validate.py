"""Input checks shared by every attention backend: bad input gets a ``ValueError`` naming the problem.

The contract is the reference's (``models.attention.reference``): values (total, H, D), offsets (B + 1,) from 0
to ``total``, never decreasing; bias tables (H, buckets) with an odd number of position columns (2R + 1);
timestamps (total,) whenever there is a time table. Backend-specific limits (the Triton backend's devices,
dtypes, head sizes) stay with the backend.
"""

from __future__ import annotations

import torch


def check_values(**tensors: torch.Tensor) -> None:
    """Every tensor is (total, heads, head_dim); all share dtype, device and (heads, head_dim)."""
    (first_name, first), *rest = tensors.items()
    for name, t in tensors.items():
        if t.dim() != 3:
            raise ValueError(f"{name} must be (total, heads, head_dim), got shape {tuple(t.shape)}")
    for name, t in rest:
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{first_name} and {name} must share dtype and device, got {first.dtype}/{first.device} "
                f"and {t.dtype}/{t.device}"
            )
        if t.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"{first_name} and {name} must share (heads, head_dim), got shapes {tuple(first.shape)} "
                f"and {tuple(t.shape)}"
            )


def check_same_rows(**tensors: torch.Tensor) -> None:
    rows = {name: t.shape[0] for name, t in tensors.items()}
    if len(set(rows.values())) > 1:
        raise ValueError(f"{', '.join(rows)} must have the same number of rows, got {rows}")


def check_offsets(name: str, offsets: torch.Tensor, values_name: str, values: torch.Tensor) -> None:
    """``offsets`` is a 1-D integer tensor on the values' device, from 0 to their row count, never decreasing."""
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor of B + 1 offsets, got shape {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if offsets.device != values.device:
        raise ValueError(f"{name} is on {offsets.device} but {values_name} is on {values.device}")
    lens = offsets[1:] - offsets[:-1]
    # One device sync for all three facts (on a GPU each .item() would be one).
    first, last, min_len = torch.stack(
        [offsets[0], offsets[-1], lens.min() if lens.numel() else offsets[0]]
    ).tolist()
    total = values.shape[0]
    if first != 0 or last != total or min_len < 0:
        raise ValueError(
            f"{name} must start at 0, never decrease and end at the number of rows of {values_name} "
            f"({total}); got first={first}, last={last}, smallest length={min_len}"
        )


def check_bias(
    q: torch.Tensor,
    pos_bias: torch.Tensor | None,
    time_bias: torch.Tensor | None,
    timestamps: torch.Tensor | None,
) -> None:
    """Bias tables (heads, buckets), floating, on q's device; a time table comes with one timestamp per row."""
    heads = q.shape[1]
    for name, table in (("pos_bias", pos_bias), ("time_bias", time_bias)):
        if table is None:
            continue
        if table.dim() != 2 or table.shape[0] != heads:
            raise ValueError(f"{name} must be (heads={heads}, buckets), got shape {tuple(table.shape)}")
        if table.device != q.device or not table.is_floating_point():
            raise ValueError(
                f"{name} must be a floating tensor on {q.device}, got {table.dtype} on {table.device}"
            )
    if pos_bias is not None and pos_bias.shape[1] % 2 != 1:
        raise ValueError(f"pos_bias needs an odd number of columns (2R + 1), got {pos_bias.shape[1]}")
    if time_bias is None:
        return
    if timestamps is None:
        raise ValueError("time_bias needs timestamps (one per row of q, in seconds)")
    if tuple(timestamps.shape) != (q.shape[0],) or timestamps.device != q.device:
        raise ValueError(
            f"timestamps must be ({q.shape[0]},) on {q.device}, got {tuple(timestamps.shape)} on "
            f"{timestamps.device}"
        )


def check_self_attention(q, k, v, offsets, pos_bias, time_bias, timestamps) -> None:
    check_values(q=q, k=k, v=v)
    check_same_rows(q=q, k=k, v=v)
    check_offsets("offsets", offsets, "q", q)
    check_bias(q, pos_bias, time_bias, timestamps)


def check_cross_attention(q, q_offsets, k, v, kv_offsets) -> None:
    check_values(q=q, k=k, v=v)
    check_same_rows(k=k, v=v)
    check_offsets("q_offsets", q_offsets, "q", q)
    check_offsets("kv_offsets", kv_offsets, "k", k)
    if q_offsets.numel() != kv_offsets.numel():
        raise ValueError(
            f"q_offsets and kv_offsets must describe the same number of sequences, got "
            f"{q_offsets.numel() - 1} and {kv_offsets.numel() - 1}"
        )
