"""gemflow's C++ CPU kernels (``torch.ops.gemflow``): built once per machine by PyTorch's extension builder, then
loaded from the cache.

Two ops: ``shared_context_attend`` (``shared_context_attend.cpp``), the serving path's attention of a request's
candidates over its user's context, fused; and ``one_user_side`` / ``one_user_score`` (``one_user.cpp``), the
one-user path's user side and candidate scoring, each in one call (ATen's GEMMs, the rest fused around them). The build (g++, ~15 s) happens on first use, or ahead of time with
``python -m models.inference.native`` (``make setup`` and the image do it); the library lands in
``$GEMFLOW_KERNELS_DIR`` (default ``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``) under a name keyed
by the source, the compiler flags and the torch version, so a changed source or another torch builds anew and a
cached one is loaded without importing the builder. The library runs on any x86-64 CPU (its AVX-512 or AVX2 code
is chosen at run time) and elsewhere takes its portable path. Where nothing can be built (no compiler), ``load`` logs why once
and returns False: callers keep PyTorch's own ops; ``GEMFLOW_NATIVE_KERNELS=0`` asks for that (A/B runs).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAME = "gemflow_kernels"
HERE = Path(__file__).parent
SOURCES = (HERE / "shared_context_attend.cpp", HERE / "one_user.cpp")
HEADERS = (HERE / "shared_context_attend.h",)  # in the build key; compiled as part of the sources
CFLAGS = ("-O3", "-fno-math-errno")


def build_directory() -> Path:
    """Where this source + flags + torch version is built: under ``GEMFLOW_KERNELS_DIR`` (a prebuilt image's),
    else ``TORCH_EXTENSIONS_DIR`` (where torch's own builds go), else ``~/.cache/torch_extensions``."""
    key = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        key.update(src.read_bytes())
    key.update(" ".join(CFLAGS).encode())
    key.update(torch.__version__.encode())
    root = (
        os.environ.get("GEMFLOW_KERNELS_DIR")
        or os.environ.get("TORCH_EXTENSIONS_DIR")
        or Path.home() / ".cache" / "torch_extensions"
    )
    return Path(root) / f"{NAME}_{key.hexdigest()[:12]}"


@cache
def load() -> bool:
    """Whether ``torch.ops.gemflow`` is loaded (built first where it is not cached)."""
    if os.environ.get("GEMFLOW_NATIVE_KERNELS", "1") == "0":
        log.info("gemflow's C++ kernels are off (GEMFLOW_NATIVE_KERNELS=0): using PyTorch's ops")
        return False
    directory = build_directory()
    library = directory / f"{NAME}.so"
    try:
        if library.is_file():
            try:
                torch.ops.load_library(str(library))
                return True
            except OSError as exc:  # a build cut short (a killed process): build it again
                log.warning("the cached kernels %s do not load (%s): building them again", library, exc)
                library.unlink()
        _build(directory)
    except Exception as exc:  # no compiler, a read-only cache: PyTorch's ops still serve
        lines = str(exc).splitlines()
        # the compiler's own words, not the build command on the first line
        rest = [line for line in lines[1:] if line.strip()]
        why = [line for line in rest if "error" in line.lower()][-3:] or rest[-2:] or lines[:1]
        log.warning("gemflow's C++ kernels are not available (%s: %s); using PyTorch's ops",
                    type(exc).__name__, " | ".join(why))  # fmt: skip
        return False
    return True


def _build(directory: Path) -> None:
    """Compile and link ``SOURCES`` into ``directory`` and load the library (torch's builder locks the directory:
    processes starting together build once)."""
    from torch.utils import cpp_extension  # imports setuptools: only when there is something to build

    directory.mkdir(parents=True, exist_ok=True)
    log.info("building gemflow's C++ kernels into %s (once per machine and torch version)", directory)
    cpp_extension.load(
        NAME, [str(s) for s in SOURCES], extra_cflags=list(CFLAGS), build_directory=str(directory),
        is_python_module=False, verbose=False,
    )  # fmt: skip


def main() -> int:
    """Build (or find) the kernels and say which path the attention takes on this CPU (without them gemflow still
    runs, on PyTorch's ops: not an error)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not load():
        print("gemflow C++ kernels: not available (above: why); PyTorch's ops serve instead")
        return 0
    bits = torch.ops.gemflow.shared_context_attend_simd_bits(16)
    path = {512: "AVX-512", 256: "AVX2"}.get(bits, "scalar")
    print(f"gemflow C++ kernels: {build_directory()} (shared-context attention, head dim 16: {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
