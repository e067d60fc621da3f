"""The step account books a profiled step's time to GEMM, attention, embedding, optimizer, communication, other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from models.attention import dispatch
from models.training.distributed import step_account
from models.training.distributed.step_account import CATEGORIES, account


def _step(w, table, q, k, v, opt):
    with record_function("gemflow.sparse_forward"):
        emb = F.embedding(torch.randint(0, table.shape[0], (64,)), table)
    with record_function("gemflow.dense_forward"):
        x = torch.relu(emb @ w)  # a GEMM outside attention, a pointwise op ("other")
        offsets = torch.tensor([0, 24, 64])
        y = dispatch.jagged_self_attention(q, k, v, offsets, backend="jagged", causal=True)
        loss = x.sum() + y.sum()
    with record_function("gemflow.backward"):
        loss.backward()
    with record_function("gemflow.optimizer_step"):
        opt.step()
        opt.zero_grad()


def test_every_category_gets_its_ops_and_the_window_adds_up():
    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    table = torch.randn(100, 32, requires_grad=True)
    q, k, v = (torch.randn(64, 2, 16, requires_grad=True) for _ in range(3))
    opt = torch.optim.AdamW([w, table, q, k, v], lr=1e-3)
    _step(w, table, q, k, v, opt)  # warm-up outside the window
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            _step(w, table, q, k, v, opt)
    acc = account(prof.events(), steps=2)
    ms = acc["seconds_per_step"]
    assert set(ms) == set(CATEGORIES)
    for category in ("gemm", "attention", "embedding", "optimizer", "other"):
        assert ms[category] > 0, category
    assert ms["communication"] == 0  # no collective ran
    assert sum(ms.values()) == pytest.approx(acc["profiled_step_seconds"], rel=1e-6)
    assert sum(acc["share"].values()) == pytest.approx(1.0, rel=1e-6)
    assert acc["non_gemm_share"] == pytest.approx(1 - acc["share"]["gemm"])


def test_backward_of_attention_ops_is_booked_to_attention():
    """The attention forward runs inside its span; its backward nodes (matched by sequence number) do not."""
    q, k, v = (torch.randn(256, 2, 16, requires_grad=True) for _ in range(3))
    offsets = torch.tensor([0, 100, 256])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("gemflow.dense_forward"):
            y = dispatch.jagged_self_attention(q, k, v, offsets, backend="jagged", causal=True)
        with record_function("gemflow.backward"):
            (y * 2).sum().backward()
    events = prof.events()
    seq: dict[int, str] = {}
    for root in (e for e in events if e.cpu_parent is None):
        step_account._forward_sequences(root, "other", seq)
    backward = [e for e in events if e.name.startswith(step_account.BACKWARD_NODE)]
    booked = {
        e.name.removeprefix(step_account.BACKWARD_NODE)
        for e in backward
        if seq.get(e.sequence_nr) == "attention"
    }
    assert any(word in name for word in ("Attention", "MoveRows", "Buckets") for name in booked), booked
    assert not any(name.startswith("MulBackward") for name in booked)  # the op outside the span stays out
    assert account(events, steps=1)["seconds_per_step"]["attention"] > 0


def test_collectives_count_as_communication():
    class FakeEvent:  # a minimal FunctionEvent: a gloo all-reduce with a copy inside, next to a GEMM
        def __init__(self, name, start, end, children=(), self_time=None):
            self.name, self.cpu_children, self.cpu_parent, self.thread = name, list(children), None, 1
            self.time_range = type("R", (), {"start": start, "end": end})()
            self.cpu_time_total = end - start
            self.self_cpu_time_total = self.cpu_time_total if self_time is None else self_time
            self.sequence_nr = -1
            for c in self.cpu_children:
                c.cpu_parent = self

    copy = FakeEvent("aten::copy_", 10, 20)
    events = [
        FakeEvent("gemflow.backward", 0, 100, [FakeEvent("c10d::allreduce_", 0, 40, [copy], 30),
                                               FakeEvent("aten::mm", 40, 90)], 10),
    ]  # fmt: skip
    events += [c for e in list(events) for c in e.cpu_children] + [copy]
    ms = account(events, steps=1)["seconds_per_step"]
    assert ms["communication"] == pytest.approx(40e-6)
    assert ms["gemm"] == pytest.approx(50e-6)
    assert ms["other"] == pytest.approx(10e-6)


def test_attention_outside_the_phases_is_no_step_time():
    """An evaluation between steps runs attention (its own span) outside the trainer's phases: not the step's."""
    q, k, v = (torch.randn(64, 2, 16) for _ in range(3))
    offsets = torch.tensor([0, 24, 64])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("gemflow.dense_forward"):
            x = torch.randn(64, 64) @ torch.randn(64, 64)
        with torch.no_grad():  # the evaluation: no phase around it
            for _ in range(20):
                dispatch.jagged_self_attention(q, k, v, offsets, backend="jagged", causal=True)
    events = prof.events()
    acc = account(events, steps=1)
    phase = next(e for e in events if e.name == "gemflow.dense_forward")
    assert acc["profiled_step_seconds"] == pytest.approx(phase.cpu_time_total / 1e6, rel=1e-6)
    assert acc["seconds_per_step"]["attention"] == 0
    assert x.shape == (64, 64)
