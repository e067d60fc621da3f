"""Local rollout: ``gemflow serve`` in the background, one version at a time (a laptop has no traffic split)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gemflow.processes import start_ticks, stop_group
from serving.rollout.base import MODEL_NAME, Deployment, RolloutError, serving_dir


def is_our_server(pid: int) -> bool:
    cmdline = Path(f"/proc/{pid}/cmdline")
    return cmdline.exists() and b"serve" in cmdline.read_bytes() and start_ticks(pid) is not None


def ready_detail(url: str) -> dict | None:
    """The model's ready answer (with the version it serves), None while it is not ready."""
    from serving.client import get

    try:
        status, body = get(f"{url}/v2/models/{MODEL_NAME}/ready", timeout=2.0)
    except OSError:
        return None
    return body if status == 200 and body.get("ready") else None


def stop_local(root: Path, timeout: float = 30.0) -> bool:
    """Stop the background server named by the pid file (only if it still is our server)."""
    pid_file = serving_dir(root) / "server.pid"
    if not pid_file.exists():
        return False
    pid = int(pid_file.read_text())
    stopped = False
    if is_our_server(pid):
        stop_group(pid, timeout)  # its own session: the server and anything it spawned
        stopped = True
    pid_file.unlink()
    return stopped


@dataclass
class LocalRollout:
    root: Path  # the workspace root
    port: int = 8080
    tracking_uri: str = ""
    timeout: float = 300.0
    mode: str = "local"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def deploy(self, model_uri: str, version: str) -> tuple[str, int, str]:
        stop_local(self.root)
        return self.url, self._start(model_uri), ""

    def is_live(self, dep: Deployment) -> bool:
        return dep.url == self.url and is_our_server(dep.pid) and ready_detail(dep.url) is not None

    def promote(self, dep: Deployment) -> None:
        """Nothing to move: the new server already takes all traffic."""

    def roll_back(self, dep: Deployment, target_uri: str, target_version: str) -> tuple[str, int]:
        stop_local(self.root)
        return self.url, self._start(target_uri)

    def _start(self, model_uri: str) -> int:
        """Start ``gemflow serve`` in the background; wait until the model is ready."""
        out = serving_dir(self.root)
        out.mkdir(parents=True, exist_ok=True)
        cmd = [str(Path(sys.executable).with_name("gemflow")), "serve", "--workspace", str(self.root),
               "--http-port", str(self.port), "--model-uri", model_uri]  # fmt: skip
        if self.tracking_uri:
            cmd += ["--set", f"tracking_uri={self.tracking_uri}"]
        log_path = out / "server.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        (out / "server.pid").write_text(str(proc.pid))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RolloutError(f"gemflow serve exited with {proc.returncode}; log tail:\n{tail}")
            if ready_detail(self.url):
                return proc.pid
            time.sleep(0.5)
        stop_local(self.root)
        raise RolloutError(
            f"the server on {self.url} was not ready within {self.timeout:.0f}s; see {log_path}"
        )
