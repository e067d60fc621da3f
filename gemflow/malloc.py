"""The process's memory settings, one place for every process that runs the model (training ranks, a
single-process ``gemflow train``, the model server and its scoring workers, the embedding refresh).

- Keep freed memory in the heap (``keep_freed_memory``). PyTorch's CPU allocator is plain ``malloc``. glibc serves
  every block above its mmap threshold (dynamic, at most 32 MiB) with a fresh ``mmap`` and unmaps it on free, so
  each training step's large activations, fp32 attention buffers and gradients, and each 1,000-candidate
  request's ~0.5-1.5 MB tensors, page-fault their memory in again (the kernel zeroes every page first): ~2 ns per
  byte, measured on the 2-core bench machine at 22 ms for a 40 MB fp32 tensor whose copy takes 1.7 ms in
  already-mapped memory, and ~800 page faults per request (~25% of the scoring CPU) in the server. With no mmap
  and a high trim threshold, freed blocks stay in the heap and the next step or request reuses them. The cost: the
  heap keeps its high-water mark; a long-lived server bounds what it keeps (``max_kept_bytes``, the trim
  threshold), a training rank, which reaches its peak every step anyway, keeps it all.
- Large tensors on transparent huge pages (``huge_pages``): faulting a fresh (users, heads, L, L) attention mask
  in 4 KiB pages cost as much as the attention itself in the embedding refresh (``bench/refresh.py``). PyTorch
  reads ``THP_MEM_ALLOC_ENABLE`` once, at its first allocation: set it before torch is imported, or in the
  environment of the processes it spawns.

Done with ``mallopt`` at process start (no environment variable has to reach the ranks), by ``gemflow train``
before a single-process run (not by ``models.training.train.train`` itself: a caller's process keeps its allocator) and by
``serving.runtime.configure``; ``GEMFLOW_KEEP_FREED_MEMORY=0`` leaves glibc's defaults. Elsewhere than glibc it
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
ENV = "GEMFLOW_KEEP_FREED_MEMORY"
THP_ENV = "THP_MEM_ALLOC_ENABLE"
KEEP_ALL = 2**31 - 1  # the largest trim threshold mallopt takes: never give freed heap back


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt(param, value)`` (1 = applied), or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def keep_freed_memory(max_kept_bytes: int = KEEP_ALL) -> bool:
    """Ask glibc's malloc to keep freed memory for reuse, up to ``max_kept_bytes`` of free heap; whether it
    applied."""
    mallopt = glibc_mallopt()
    if os.environ.get(ENV, "1") == "0" or mallopt is None:
        return False
    applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, min(max_kept_bytes, KEEP_ALL)) == 1
    if not applied:
        log.warning("mallopt refused: freed memory goes back to the OS (page faults on every large tensor)")
    return applied


def huge_pages() -> None:
    """Large CPU tensors on transparent huge pages, in this process (when torch is not imported yet) and in the
    processes it starts; an explicit ``THP_MEM_ALLOC_ENABLE`` (``=0`` to compare) wins."""
    os.environ.setdefault(THP_ENV, "1")
