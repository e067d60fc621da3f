"""Issue 34's acceptance: the README's own-data example, run as a user runs it.

The commands are read from the document's marked block, not copied here; the test only appends tiny-model
``--set`` flags to the two ``train`` lines and its own port to ``serve`` / ``rank``. It runs on a generated shop
log with string user ids and SKUs and a purchase column, and again with 1e11-sized integer ids.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from serving.client import get
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "README.md"
MARKER = "<!-- own-data-example -->"
TINY = {
    "user": ["--set", "optim.epochs=1", "--set", "user_model.d_model=16", "--set", "user_model.num_heads=2",
             "--set", "user_model.num_layers=1", "--set", "user_model.max_history=64"],
    "ranker": ["--set", "optim.epochs=1", "--set", "ranker.d_model=16", "--set", "ranker.num_heads=2",
               "--set", "ranker.num_layers=1"],
}  # fmt: skip
# the ids the example's ``rank`` line names, and what they are in the integer-id log
INTEGER_IDS = {"u_1834": "100000000034", "SKU-SA28": "200000000018", "SKU-AA10": "200000000000",
               "SKU-NEW1": "299999999999"}  # fmt: skip


def example_commands() -> list[str]:
    """The bash block right after the marker in the README, one command per line."""
    text = DOC.read_text()
    block = re.search(re.escape(MARKER) + r"\s*```bash\n(.*?)```", text, re.S)
    assert block, f"{DOC} lost its marked example block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def shop_log(integer_ids: bool, n: int = 1200, seed: int = 0) -> pd.DataFrame:
    """A shop's log over 2026-03-01..04: 40 customers, 30 SKUs, clicks tied to (customer, SKU), purchases."""
    rng = np.random.default_rng(seed)
    u, s = rng.integers(0, 40, n), rng.integers(0, 30, n)
    if integer_ids:
        users, skus = 100_000_000_000 + np.arange(40), 200_000_000_000 + np.arange(30)
    else:
        users = np.array([f"u_{1800 + i}" for i in range(40)])
        skus = np.array([f"SKU-{chr(65 + i % 26)}{chr(65 + i // 26)}{10 + i}" for i in range(30)])
    seconds = np.sort(rng.integers(0, 4 * 86_400, n))
    ts = pd.Timestamp("2026-03-01T00:00:00Z") + pd.to_timedelta(seconds, unit="s")
    clicked = (rng.random(n) < 0.2 + 0.4 * ((u + s) % 3 == 0)).astype(int)
    return pd.DataFrame(
        {
            "customer": users[u],
            "sku": skus[s],
            "time": ts.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "clicked": clicked,
            "purchased": (clicked & (rng.random(n) < 0.3)).astype(int),
        }
    )


def _run(argv: list[str], env: dict, cwd: Path) -> str:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def _serve(argv: list[str], env: dict, cwd: Path, port: int, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"gemflow serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if get(f"http://127.0.0.1:{port}/v2/models/gem-ranker/ready", timeout=2)[0] == 200:
                status, meta = get(f"http://127.0.0.1:{port}/v2/models/gem-ranker", timeout=2)
                # ours, not another process on a reused port: alive, serving the registered champion
                assert proc.poll() is None and meta["versions"][0].startswith("gem-ranker/"), meta
                return proc
        except OSError:
            pass
        assert time.monotonic() < deadline, f"server not ready:\n{log.read_text()[-3000:]}"
        time.sleep(1)


@pytest.mark.integration
@pytest.mark.parametrize("integer_ids", [False, True], ids=["string-ids", "1e11-integer-ids"])
def test_the_documented_own_data_example_runs(tmp_path, integer_ids):
    shop_log(integer_ids).to_csv(tmp_path / "shop.csv", index=False)
    gemflow = str(Path(sys.executable).with_name("gemflow"))
    env = {**os.environ, "PWD": str(tmp_path), "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("GEMFLOW_HOME", None)
    port, server, answer = free_port(), None, ""
    try:
        for line in example_commands():
            if integer_ids:
                for text, number in INTEGER_IDS.items():
                    line = line.replace(text, number)
            if line.startswith("export "):
                name, value = line.removeprefix("export ").split("=", 1)
                env[name] = value.replace("$PWD", str(tmp_path))
                continue
            background = line.endswith("&")
            argv = shlex.split(line.rstrip("&"))
            assert argv[0] == "gemflow", line
            argv[0] = gemflow
            if argv[1] == "train":
                argv += TINY[argv[argv.index("-m") + 1]]
            if argv[1] == "serve":
                argv += ["--http-port", str(port)]
            if argv[1] == "rank":
                argv += ["--url", f"http://127.0.0.1:{port}"]
            if background:
                server = _serve(argv, env, tmp_path, port, tmp_path / "serve.log")
            else:
                answer = _run(argv, env, tmp_path)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    user = INTEGER_IDS["u_1834"] if integer_ids else "u_1834"
    known = [INTEGER_IDS[s] if integer_ids else s for s in ("SKU-SA28", "SKU-AA10")]
    unknown = INTEGER_IDS["SKU-NEW1"] if integer_ids else "SKU-NEW1"
    ranked = [line.split()[1] for line in answer.splitlines() if line.startswith("ad ")]
    assert sorted(ranked) == sorted([*known, unknown]), answer  # the caller's own ids come back
    meta = json.loads(answer[answer.index("{") :])
    fallback = meta["fallback"]
    assert fallback["unknown_user_id"] is False and fallback["unknown_ad_ids"] == 1, (user, meta)
    assert meta["model_version"] and meta["embedding_version"]
