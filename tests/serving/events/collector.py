"""A workspace the live event path can run against (DAY0 ingested; DAY1's users and ads snapshots landed) and a
real ``gemflow events serve`` process over HTTP."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pandas as pd
import pyarrow.parquet as pq

from features.ingest import IngestConfig, ingest
from gemflow.workspace import Workspace
from tests.features.helpers import DAY0, ads_frame, to_arrow, users_frame, write_raw
from tests.ports import free_port

DAY1 = DAY0 + dt.timedelta(days=1)
N = 6  # a short list, so the tests' users overflow it
SETTINGS = (
    "limits.max_age_days=3650",  # the helpers' days are long past
    "export_every_s=0.3",
    f"recent_events={N}",
)


def ingest_config(**store) -> IngestConfig:
    from features.feature_repo import FeatureStoreConfig

    return IngestConfig(gate={"data_docs": False}, recent_events=N, feature_store=FeatureStoreConfig(**store))


def prepare(ws: Workspace, **store) -> None:
    """DAY0 landed and ingested (ads offline, lists online); DAY1's snapshots landed, its events not."""
    write_raw(ws, DAY0)
    ingest(ws, DAY0, ingest_config(**store))
    for table, frame in (("users", users_frame(DAY1)), ("ads", ads_frame(DAY1))):
        folder = ws.raw(table, DAY1)
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(to_arrow(table, frame), folder / "part-00000.parquet")


def as_json(events: pd.DataFrame) -> list[dict]:
    out = []
    for row in events.itertuples(index=False):
        out.append({"event_id": int(row.event_id), "user_id": int(row.user_id), "ad_id": int(row.ad_id),
                    "action": row.action, "surface": row.surface, "ts": row.ts.isoformat(),
                    "click": int(row.click), "conversion": int(row.conversion)})  # fmt: skip
    return out


class CollectorProcess:
    def __init__(self, ws: Workspace, log: Path, *settings: str, env: dict | None = None):
        self.ws, self.log, self.settings = ws, log, settings
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> None:
        cmd = [sys.executable, "-m", "gemflow.cli", "events", "serve", "-w", str(self.ws.root),
               "--port", str(self.port)]  # fmt: skip
        for s in (*SETTINGS, *self.settings):
            cmd += ["--set", s]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the collector exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health/live", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the collector did not start: {self.log.read_text()[-3000:]}")

    def post(self, body=None, token: str | None = None, content: bytes | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if content is None:
            return httpx.post(f"{self.url}/v1/events", json=body, headers=headers, timeout=30)
        return httpx.post(f"{self.url}/v1/events", content=content, headers=headers, timeout=30)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=30)

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no drain, no shutdown hook
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@contextlib.contextmanager
def running(ws: Workspace, log: Path, *settings: str, env: dict | None = None):
    collector = CollectorProcess(ws, log, *settings, env=env)
    collector.start()
    try:
        yield collector
    finally:
        collector.stop()
