"""Keep freed memory in the process: a training rank re-allocates the same large tensors every step.

PyTorch's CPU allocator is plain ``malloc``. glibc serves every block above its mmap threshold (dynamic, at most
32 MiB) with a fresh ``mmap`` and unmaps it on free, so each step's large activations, fp32 attention buffers
and gradients page-fault their memory in again (the kernel zeroes every page first): ~2 ns per byte, measured on
the 2-core bench machine at 22 ms for a 40 MB fp32 tensor whose copy takes 1.7 ms in already-mapped memory.
With no mmap and a high trim threshold, freed blocks stay in the heap and the next step reuses them.

Done with ``mallopt`` at rank start (no environment variable has to reach the ranks) and by ``gemflow train``
before a single-process run (not by ``models.train.train`` itself: a caller's process keeps its allocator);
``GEMFLOW_KEEP_FREED_MEMORY=0`` leaves glibc's defaults. Elsewhere than glibc it does nothing. The cost: the heap keeps its high-water mark
(the ranks' peak memory, which they reach every step anyway) until the process ends.
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


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse; whether it applied."""
    mallopt = glibc_mallopt()
    if os.environ.get(ENV, "1") == "0" or mallopt is None:
        return False
    applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not applied:
        log.warning("mallopt refused: freed memory goes back to the OS (page faults on every large tensor)")
    return applied
