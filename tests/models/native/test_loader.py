"""``models.inference.native.load`` as a fresh process meets it: a cached library, a broken one, no compiler, switched off.

Each case runs in its own interpreter (a process can register the ``gemflow`` op namespace once) with its own
kernel directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from models.inference import native
ok = native.load()
print("LOADED", ok)
if ok:
    q, keys, values = torch.ones(3, 8), torch.ones(1, 8, 5), torch.ones(1, 5, 8)
    print("OUT", torch.ops.gemflow.shared_context_attend(q, keys, values).sum().item())
"""


def _probe(kernels: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "GEMFLOW_KERNELS_DIR": str(kernels), **env}
    return subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.integration
def test_a_broken_cached_library_is_built_again(tmp_path):
    built = _probe(tmp_path)  # an empty directory: builds
    assert "LOADED True" in built.stdout and "OUT 24.0" in built.stdout, built.stdout + built.stderr
    assert "building gemflow's C++ kernels" in built.stderr
    library = next(tmp_path.glob("gemflow_kernels_*/gemflow_kernels.so"))
    again = _probe(tmp_path)  # cached: loaded, not built
    assert "LOADED True" in again.stdout and "building" not in again.stderr
    library.write_bytes(b"not a shared library")  # a link cut short
    rebuilt = _probe(tmp_path)
    assert "do not load" in rebuilt.stderr and "building gemflow's C++ kernels" in rebuilt.stderr
    assert "LOADED True" in rebuilt.stdout and "OUT 24.0" in rebuilt.stdout, rebuilt.stdout + rebuilt.stderr


def test_without_a_compiler_pytorch_ops_serve_and_the_log_says_why(tmp_path):
    missing = _probe(tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    assert "LOADED False" in missing.stdout, missing.stdout + missing.stderr
    assert "gemflow's C++ kernels are not available" in missing.stderr
    assert "no-such-compiler: not found" in missing.stderr  # the reason, not only the build command
    assert "Traceback" not in missing.stderr


def test_switched_off_by_environment(tmp_path):
    off = _probe(tmp_path, GEMFLOW_NATIVE_KERNELS="0")
    assert "LOADED False" in off.stdout and "GEMFLOW_NATIVE_KERNELS=0" in off.stderr
    assert not any(tmp_path.iterdir())  # nothing built
