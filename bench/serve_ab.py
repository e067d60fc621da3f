"""Side-by-side A/B of two (or more) running ranker servers: alternating bursts of closed-loop requests.

On a machine whose speed drifts (a shared VM: the same code measured 2x apart an hour later), only figures taken
in alternation compare. Each round sends one burst to every server in turn (``--clients`` keep-alive clients,
``--per-client`` 1,000-candidate requests each, the bench world's healthy users) and records the server's CPU
seconds per request (its process and its child processes, from /proc) and the burst's requests per second; medians
over ``--rounds``, the order reversed every other round (in a fixed order the first server of each round measured
3-6% more CPU per request; with the order swapped the two measured the same). With ``--rate R`` each burst is open
loop instead (R requests/s, a p99 instead of req/s).
``--overload N`` then sends each server one closed-loop burst from N clients (several times its admission slots)
and prints its status counts and the share of its 200s that were degraded, by reason (issue 35: 31% answered
``feature_store_busy`` while the store was healthy).

    # two servers on one bench world (bench/serve.py --build-world /tmp/gemflow-bench built it), e.g. main vs a branch
    .venv/bin/python -m gemflow.cli serve --workspace /tmp/gemflow-bench/ws --model-uri /tmp/gemflow-bench/ranker \\
        --http-port 18091 --set limits.max_candidates=5000 &
    (cd ../other-checkout && ... --http-port 18092 ...) &
    .venv/bin/python bench/serve_ab.py --ports 18091,18092 --clients 2 --rounds 8
"""

from __future__ import annotations

import argparse
import concurrent.futures
import re
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import PREDICT, Client, cpu_seconds, request_body  # noqa: E402

from bench.report import add_record_flag, record  # noqa: E402
from tests.serving.world import HEALTHY_USERS, REQUEST_TS  # noqa: E402


def server_process(port: int) -> psutil.Process:
    """The server on ``port``: the process listening there, or, where several listen (``server_processes`` > 1),
    their supervisor (``cpu_seconds`` counts its children)."""
    pids = {c.pid for c in psutil.net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.status == "LISTEN" and c.pid}  # fmt: skip
    if not pids:
        raise SystemExit(f"error: no process listens on 127.0.0.1:{port}")
    if len(pids) == 1:
        return psutil.Process(pids.pop())
    parents = {psutil.Process(pid).ppid() for pid in pids}
    if len(parents) != 1:
        raise SystemExit(f"error: processes {sorted(pids)} listen on port {port} with no common parent")
    return psutil.Process(parents.pop())


def burst(
    port: int, proc: psutil.Process, bodies: list[bytes], clients: int, per_client: int
) -> tuple[float, float]:
    """(server CPU ms per request, requests per second) of one closed-loop burst."""
    conns = [Client(f"http://127.0.0.1:{port}") for _ in range(clients)]

    def run(conn: Client, k: int) -> None:
        for i in range(per_client):
            status = conn.post(PREDICT, bodies[(i * clients + k) % len(bodies)])[0]
            if status != 200:
                raise SystemExit(f"error: server on port {port} answered {status}")

    threads = [threading.Thread(target=run, args=(conn, k)) for k, conn in enumerate(conns)]
    cpu0, wall0 = cpu_seconds(proc), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n = clients * per_client
    return 1e3 * (cpu_seconds(proc) - cpu0) / n, n / (time.perf_counter() - wall0)


def open_burst(
    port: int, proc: psutil.Process, bodies: list[bytes], rate: float, n: int
) -> tuple[float, float]:
    """(server CPU ms per request, p99 latency ms) of ``n`` requests sent open loop at ``rate`` per second (an
    idle server between requests wakes for each one: the CPU per request of a server at moderate load)."""
    local, took = threading.local(), []

    def one(i: int, due: float) -> None:
        if not hasattr(local, "client"):
            local.client = Client(f"http://127.0.0.1:{port}")
        status = local.client.post(PREDICT, bodies[i % len(bodies)])[0]
        took.append(1e3 * (time.perf_counter() - due))
        if status != 200:
            raise SystemExit(f"error: server on port {port} answered {status}")

    cpu0, start = cpu_seconds(proc), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for i in range(n):
            due = start + i / rate
            time.sleep(max(0.0, due - time.perf_counter()))
            pool.submit(one, i, due)
    return 1e3 * (cpu_seconds(proc) - cpu0) / n, float(np.percentile(took, 99))


def overload(port: int, bodies: list[bytes], clients: int, per_client: int) -> tuple[Counter, Counter]:
    """(status counts, degraded reasons among the 200s) of one closed-loop burst from ``clients`` clients."""
    statuses, reasons, lock = Counter(), Counter(), threading.Lock()

    def run(k: int) -> None:
        conn = Client(f"http://127.0.0.1:{port}")
        for i in range(per_client):
            status, body = conn.post(PREDICT, bodies[(i * clients + k) % len(bodies)])
            fb = orjson.loads(body)["fallback"] if status == 200 else None
            with lock:
                statuses[status] += 1
                if fb is not None:
                    reasons.update(fb["reasons"] if fb["degraded"] else ["(not degraded)"])
        conn.close()

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(run, range(clients)))
    return statuses, reasons


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ports", required=True, help="comma-separated ports of running servers (127.0.0.1)")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-client", type=int, default=60, help="requests per client per burst")
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="> 0: open-loop bursts at this many requests/s (clients x per-client requests each)",
    )
    ap.add_argument(
        "--overload", type=int, default=0, help="> 0: then one closed-loop burst from this many clients"
    )
    ap.add_argument("--candidates", type=int, default=1000)
    ap.add_argument("--num-ads", type=int, default=6000)
    ap.add_argument("--labels", help="comma-separated names of the servers, one per port (for --record rows)")
    add_record_flag(ap)
    args = ap.parse_args()
    ports = [int(p) for p in args.ports.split(",")]
    labels = args.labels.split(",") if args.labels else [str(p) for p in ports]
    if len(labels) != len(ports):
        raise SystemExit(f"error: {len(labels)} --labels for {len(ports)} --ports")
    rows: list[tuple[str, str]] = []
    procs = {p: server_process(p) for p in ports}
    rng = np.random.default_rng(0)
    bodies = [request_body(rng, list(HEALTHY_USERS), args.num_ads, args.candidates, float(REQUEST_TS))
              for _ in range(50)]  # fmt: skip
    for p in ports:  # warm-up burst, not counted
        burst(p, procs[p], bodies, args.clients, 10)
    results: dict[int, list[tuple[float, float]]] = {p: [] for p in ports}
    for r in range(args.rounds):
        for p in ports if r % 2 == 0 else ports[::-1]:  # ABBA: whichever goes first in a round pays for it
            if args.rate > 0:
                results[p].append(open_burst(p, procs[p], bodies, args.rate, args.clients * args.per_client))
            else:
                results[p].append(burst(p, procs[p], bodies, args.clients, args.per_client))
    loop = f"open loop at {args.rate:g} req/s" if args.rate > 0 else f"{args.clients} closed-loop clients"
    print(f"{loop}, {args.candidates} candidates, {args.rounds} alternating rounds")
    for p in ports:
        cpu = [r[0] for r in results[p]]
        second = statistics.median(r[1] for r in results[p])
        print(f"  port {p}: server CPU {statistics.median(cpu):.2f} ms/request (median; rounds "
              f"{' '.join(f'{x:.2f}' for x in cpu)}), "
              + (f"p99 {second:.1f} ms median" if args.rate > 0 else f"{second:.0f} req/s median"))  # fmt: skip
        unit = f"{second:.1f} ms p99" if args.rate > 0 else f"{second:.0f} req/s"
        rows.append((f"{labels[ports.index(p)]}: {loop}, {args.rounds} rounds: server CPU per request (median), "
                     + ("p99" if args.rate > 0 else "req/s"), f"{statistics.median(cpu):.2f} ms, {unit}"))  # fmt: skip
    for p in ports if args.overload > 0 else []:
        statuses, reasons = overload(p, bodies, args.overload, args.per_client)
        answered = statuses[200]
        degraded = answered - reasons["(not degraded)"]
        print(
            f"  port {p}, {args.overload} closed-loop clients: statuses {dict(sorted(statuses.items()))}, degraded "
            f"{degraded}/{answered} of the 200s ({100 * degraded / max(answered, 1):.1f}%), reasons {dict(reasons)}"
        )
        rows.append((f"{labels[ports.index(p)]}: {args.overload} closed-loop clients: statuses, degraded 200s",
                     f"{dict(sorted(statuses.items()))}, {100 * degraded / max(answered, 1):.1f}%"))  # fmt: skip
    if args.record:
        key = "serve-ab." + "-".join(re.sub(r"[^a-z0-9_.-]", "-", x.lower()) for x in labels)
        record(key, f"side by side: {' vs '.join(labels)} (bench/serve_ab.py)", rows)


if __name__ == "__main__":
    main()
