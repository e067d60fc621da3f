"""Start a real MLflow tracking server on the embedded defaults (SQLite backend, local artifacts)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def server_command(root: Path, host: str = "127.0.0.1", port: int = 5000, workers: int = 1) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    return [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
        "--host", host,
        "--port", str(port),
        "--workers", str(workers),
        "--allowed-hosts", f"{host},{host}:{port},localhost,localhost:{port}",
    ]  # fmt: skip


def start_server(
    root: Path, host: str = "127.0.0.1", port: int = 5000, timeout: float = 90, new_session: bool = False
) -> subprocess.Popen:
    """Start the server and wait for /health; the caller stops it (``proc.terminate()``). ``new_session``: in a
    process group of its own (its id is ``proc.pid``), so that ``os.killpg`` reaches its workers too."""
    root.mkdir(parents=True, exist_ok=True)
    log = open(root / "server.log", "ab")  # noqa: SIM115 (the server process owns it)
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(
        server_command(root, host, port),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=new_session,
    )
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}; see {root / 'server.log'}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise TimeoutError(f"mlflow server did not answer on {url} within {timeout:.0f}s")
