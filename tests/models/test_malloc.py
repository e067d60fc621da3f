"""keep_freed_memory: a large tensor allocated again after being freed reuses mapped memory (no page faults)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from gemflow.malloc import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
def faults_of_one_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB: above glibc's largest mmap threshold
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
steps = [faults_of_one_step() for _ in range(20)]  # the heap reaches its high-water mark within a few steps
print(applied, min(steps[10:]))
"""


def faults(mode: str) -> tuple[bool, int]:
    # glibc's defaults, measured alone: the gemflow CLI (imported by earlier tests) sets THP_MEM_ALLOC_ENABLE,
    # whose 2 MiB pages fault 512x less often for the same zeroing work
    env = {
        k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "GEMFLOW_KEEP_FREED_MEMORY")
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, env=env
    )
    applied, count = out.stdout.split()
    return applied == "True", int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults():
    applied, kept = faults("keep")
    if not applied:
        pytest.skip("not glibc")
    _, default = faults("default")
    assert default > 10_000  # 64 MiB of 4 KiB pages mapped in again
    assert kept < 1_000
