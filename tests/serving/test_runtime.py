"""Process settings of the serving process (serving.runtime). Their effect on speed (no page faults per request,
threads per worker) is measured by ``bench/serve.py`` (server CPU per request), not asserted here."""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from gemflow.malloc import keep_freed_memory
from serving import runtime


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc tuning is glibc-only")
def test_glibc_accepts_the_servers_bounded_malloc_setting():
    assert keep_freed_memory(runtime.MAX_KEPT_BYTES)


def test_configure_sets_the_intra_op_threads():
    before = torch.get_num_threads()
    try:
        runtime.configure(1)
        assert torch.get_num_threads() == 1
        runtime.worker_init(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_configure_sets_the_gil_switch_interval_only_when_asked():
    before = sys.getswitchinterval()
    try:
        runtime.configure(torch.get_num_threads())
        assert sys.getswitchinterval() == before
        runtime.configure(torch.get_num_threads(), gil_switch_ms=0.5)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
