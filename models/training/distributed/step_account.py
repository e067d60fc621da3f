"""Where a profiled training step goes: GEMMs, attention, embedding lookups, optimizer, communication, other.

The trainer profiles a window of steps (``distributed.step_account``) with ``torch.profiler``; ``account`` walks
the CPU event tree of the step's thread top-down and gives every microsecond of the window one category:

- ``gemm``: the whole time of a matmul kernel (``aten::mm``/``addmm``/``bmm``/``baddbmm``/``_scaled_mm``...),
  wherever it runs (projections, FFN, attention's math-kernel matmuls, their backward);
- ``communication``: the whole time of a collective (c10d/gloo/nccl ops, DeepSpeed's ``record_param_comms``):
  blocking collectives include the wait for the slowest rank;
- the rest by context, self time only: ``attention`` inside a ``gemflow.attention`` span (the jagged/fused
  kernels, bucketing, bias gathers) and the backward nodes of those forward ops (matched by autograd sequence
  number), ``embedding`` inside ``gemflow.sparse_forward`` and its backward nodes (torchrec's fused lookups and
  in-backward Adagrad), ``optimizer`` inside ``gemflow.optimizer_step``;
- ``other`` = the phases' wall time minus all of the above: norms, biases, activations, casts, copies, the
  loss, batch building, Python and the profiler's own per-op overhead.

The window's wall time includes the profiler's overhead (every op pays a few microseconds), so shares are
those of the profiled steps; ``profiled_step_seconds`` next to the unprofiled median tells how much it adds.
"""

from __future__ import annotations

CATEGORIES = ("gemm", "attention", "embedding", "optimizer", "communication", "other")
GEMM_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::_scaled_mm",
        "aten::_int_mm",
        "aten::mkldnn_linear",
        "mkldnn::_linear_pointwise",
    }
)
COMM_MARKERS = ("c10d", "gloo", "nccl", "record_param_comms", "all_to_all", "alltoall", "all2all", "allreduce",
                "all_reduce", "reduce_scatter", "all_gather", "allgather", "broadcast", "barrier")  # fmt: skip
SPANS = {  # record_function spans (trainer phases, the attention dispatch) -> the category of their self time
    "gemflow.attention": "attention",
    "gemflow.sparse_forward": "embedding",
    "gemflow.optimizer_step": "optimizer",
}
BACKWARD_NODE = "autograd::engine::evaluate_function: "
# spans that mark work inside a phase, never a phase: at the top level (an evaluation or the model export between
# steps, which run outside the trainer's phases) they are no step time
INNER_SPANS = frozenset({"gemflow.attention"})


def _is_comm(name: str) -> bool:
    low = name.lower()
    return any(m in low for m in COMM_MARKERS)


def account(events, steps: int) -> dict:
    """Seconds per step in each of ``CATEGORIES`` over a profiled window of ``steps`` steps.

    ``events``: ``profiler.events()`` (FunctionEvents with parents/children). The step is the sum of the
    trainer's top-level ``gemflow.*`` phase spans (batch, sparse forward, dense forward, backward, optimizer
    step; backward runs on the same thread on CPU; not an attention span outside them, e.g. of an evaluation
    between steps); without such spans, every top-level event.
    """
    roots = [e for e in events if e.cpu_parent is None]
    phases = [e for e in roots if e.name.startswith("gemflow.") and e.name not in INNER_SPANS]
    if phases:  # the step's phase spans only: an evaluation or checkpoint inside the window is no step time
        roots = phases
    if not roots or steps < 1:
        return {}
    # forward ops under an attention / embedding span: their backward nodes carry the same sequence number
    seq_category: dict[int, str] = {}
    for root in roots:
        _forward_sequences(root, "other", seq_category)
    totals = dict.fromkeys(CATEGORIES, 0.0)  # microseconds
    for root in roots:
        _walk(root, "other", seq_category, totals)
    window = sum(e.time_range.end - e.time_range.start for e in roots)
    totals["other"] = max(window - sum(totals[c] for c in CATEGORIES if c != "other"), 0.0)
    per_step = {c: totals[c] / 1e6 / steps for c in CATEGORIES}
    step = window / 1e6 / steps
    return {
        "profiled_steps": steps,
        "profiled_step_seconds": step,
        "seconds_per_step": per_step,
        "share": {c: (per_step[c] / step if step > 0 else 0.0) for c in CATEGORIES},
        "non_gemm_share": 1.0 - per_step["gemm"] / step if step > 0 else float("nan"),
    }


def _forward_sequences(event, category: str, out: dict[int, str]) -> None:
    category = SPANS.get(event.name, category)
    if category in ("attention", "embedding") and getattr(event, "sequence_nr", -1) >= 0:
        out.setdefault(event.sequence_nr, category)
    for child in event.cpu_children:
        _forward_sequences(child, category, out)


def _walk(event, category: str, seq_category: dict[int, str], totals: dict[str, float]) -> None:
    name = event.name
    if name in GEMM_OPS:
        totals["gemm"] += event.cpu_time_total
        return
    if _is_comm(name):
        totals["communication"] += event.cpu_time_total
        return
    if name.startswith(BACKWARD_NODE) and getattr(event, "sequence_nr", -1) in seq_category:
        category = seq_category[event.sequence_nr]
    category = SPANS.get(name, category)
    totals[category] += event.self_cpu_time_total
    for child in event.cpu_children:
        _walk(child, category, seq_category, totals)
