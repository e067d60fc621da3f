"""``bench/gpu_attention.py --quick`` on a machine without a GPU: the whole prepared script, kernels interpreted.

The GPU run happens once, on a GPU machine; this keeps the script from rotting in between: the correctness
gate, every case of the table (Triton and padded SDPA, forward and forward + backward) and the user-model
training step with each backend must all run and report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]


def test_quick_cpu_smoke_run_reports_every_case_and_backend(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "bench/gpu_attention.py", "--quick", "--json", str(out)]
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    log = f"{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    assert "CPU smoke run" in proc.stdout, log

    result = json.loads(out.read_text())
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        from gpu_attention import CASES, CPU_SMOKE_PLAN
    finally:
        sys.path.pop(0)
    expected = {(case, p) for case in CASES for p in ("fwd", "fwd+bwd")}
    assert {(r["case"], r["pass_"]) for r in result["rows"]} == expected
    for row in result["rows"]:
        assert row["triton_ms"] > 0 and row["sdpa_ms"] > 0, row
        assert row["max_len"] in CPU_SMOKE_PLAN.max_lens and 0 < row["fill"] <= 0.30, row
    steps = {r["backend"]: r for r in result["user_model"]}
    backends = ("triton", "padded_sdpa", "jagged", "reference")
    assert set(steps) == set(backends), result["user_model"]
    losses = [steps[b]["first_loss"] for b in backends]
    assert max(losses) - min(losses) <= 1e-2 * abs(losses[-1]), losses  # same step, bf16 autocast
