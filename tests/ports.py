"""Ports for the servers tests start, that no other test process can be handed at the same time.

A port from ``bind(("127.0.0.1", 0))`` is free only until its socket closes: a server that takes seconds to load
before it binds leaves it free, the kernel can hand it to a second test process meanwhile, and that process's
readiness probe is then answered by the first server (two pytest workers, the second's tests talking to the first
one's server: counts that did not add up, seen in CI). Here each pytest-xdist worker draws from its own range below
the kernel's ephemeral ports (32768 and up on Linux), never twice in a process, and checks the port is free now.
"""

from __future__ import annotations

import itertools
import os
import socket

FIRST, PER_WORKER = 20000, 600  # 20 workers fit below 32768
_drawn = itertools.count()


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    base = FIRST + PER_WORKER * (int(worker.removeprefix("gw") or 0) % 20)
    for _ in range(PER_WORKER):
        port = base + next(_drawn) % PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken by something else: the next one
                continue
            return port
    raise RuntimeError(f"no free port in {base}..{base + PER_WORKER - 1}")
