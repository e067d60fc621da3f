"""``server_processes`` > 1: the whole server N times over, on one port (prefork).

Why: one server process scores concurrent requests on threads that share its GIL; every request's Python (HTTP,
parsing, the Feast read, tensor building) waits for it. On 2 cores under 4 closed-loop clients one process left
~20% of the CPU idle. N processes, each with its own event loop, store reads and scoring, share nothing but the
port: each listens on its own ``SO_REUSEPORT`` socket and the kernel spreads new connections over them
(docs/serving-speed.md, round 6).

The supervisor (``gemflow serve``'s own process) holds the port, points ``$PROMETHEUS_MULTIPROC_DIR`` at a fresh
folder so that ``/metrics`` and the stats of any process count the whole server (``serving.stats``), starts the
processes (``spawn``: each loads the model itself), replaces one that dies (after ``gemflow.processes.Backoff``'s
wait, as the server's other children) and stops them all on SIGTERM / SIGINT.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from gemflow.processes import Backoff, ProcessRef, stop_processes, when_gone
from serving.config import ServingConfig
from serving.stats import SHARED_METRICS_ENV

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often the supervisor looks at its processes
STOP_GRACE_S = 30.0


class StartFailed(RuntimeError):
    """The server processes cannot start: the port is taken, or one exited before its model was loaded."""


def bind(host: str, port: int, listen: bool = True) -> socket.socket:
    """A TCP socket on ``host:port`` with SO_REUSEPORT: every server process listens on one of its own and the kernel
    spreads new connections over them by their addresses (one shared socket gave nearly all of them to whichever
    process was awake first: 7 of 8). The supervisor's, never listening, holds the port for the server's life."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio sets TCP_NODELAY only on accepted sockets whose proto is IPPROTO_TCP (with the default
    # 0, every small response waited ~40 ms for the client's delayed ACK)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise StartFailed(f"cannot listen on {host}:{port}: {err.strerror}") from err
    if listen:
        sock.listen(2048)
    return sock


def listen(cfg: ServingConfig, loaded) -> socket.socket:
    """A loaded server process's own listening socket (only now: the kernel would queue connections to a process
    still loading its model), and the supervisor told it is up."""
    sock = bind(cfg.host, cfg.http_port)
    loaded.set()
    return sock


def _child(cfg: ServingConfig, ws_root: str, loaded, supervisor: ProcessRef) -> None:
    from gemflow.workspace import Workspace
    from serving.auth import AuthError
    from serving.model_source import ModelLoadError
    from serving.server import serve

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the supervisor; it stops us
    # killed with SIGKILL, the supervisor stops nobody: an orphan would keep answering on the port, and a server
    # started there again would share it with the old model
    when_gone(supervisor, lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        serve(cfg, Workspace(Path(ws_root)), listen=lambda: listen(cfg, loaded))
    except (ModelLoadError, AuthError, StartFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


class Supervisor:
    def __init__(self, cfg: ServingConfig, ws_root: Path):
        self.cfg = replace(cfg, server_processes=1)  # what each process runs: one server
        self.count, self.ws_root = cfg.server_processes, str(ws_root)
        self.stopping = threading.Event()
        self.ctx = mp.get_context("spawn")

    def _start(self) -> tuple[mp.Process, object]:
        """A started server process and the event it sets once it listens (its model loaded)."""
        loaded = self.ctx.Event()
        proc = self.ctx.Process(
            target=_child, args=(self.cfg, self.ws_root, loaded, ProcessRef.me()), name="gemflow-server"
        )
        proc.start()
        return proc, loaded

    def run(self) -> None:
        """Serve until SIGTERM / SIGINT; returns once every server process has exited."""
        from prometheus_client import multiprocess

        port = bind(self.cfg.host, self.cfg.http_port, listen=False)
        with tempfile.TemporaryDirectory(prefix="gemflow-metrics-") as metrics_dir:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the spawned processes
            os.environ[SHARED_METRICS_ENV] = "1"  # ... which sum their metrics there (serving.stats)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stopping.set())
            procs = [self._start() for _ in range(self.count)]
            log.info("%d server processes on http://%s:%d: %s", self.count, self.cfg.host,
                     self.cfg.http_port, [p.pid for p, _ in procs])  # fmt: skip
            try:
                self._watch(procs, multiprocess.mark_process_dead)
            finally:
                stop_processes([p for p, _ in procs], STOP_GRACE_S)
                port.close()

    def _watch(self, procs: list, mark_dead) -> None:
        """Replace a server process that exits, after ``gemflow.processes.Backoff``'s wait (at once, then 1 s, 2,
        4, ... while they keep dying), until stopped; one that exits before it listened stops the server."""
        backoff, due = Backoff(), {}  # due: slot -> when its replacement starts
        while not self.stopping.wait(POLL_S):
            now = time.monotonic()
            for i, (proc, loaded) in enumerate(procs):
                if i in due:  # dead, its replacement waiting for its time
                    if now >= due[i]:
                        del due[i]
                        procs[i] = self._start()
                        log.warning("server process %d started (replaces %d)", procs[i][0].pid, proc.pid)
                    continue
                if proc.is_alive():
                    continue
                if not loaded.is_set():
                    raise StartFailed(f"a server process exited (code {proc.exitcode}) before it "
                                      "listened: see its error above")  # fmt: skip
                mark_dead(proc.pid)  # its gauges leave the sums; counters stay
                due[i] = now + backoff.next_delay()
                log.warning("server process %d exited (code %s); a replacement starts in %.1f s", proc.pid,
                            proc.exitcode, due[i] - now)  # fmt: skip
