"""Load bench of the online ranker: drives a running ``gemflow serve`` on 127.0.0.1 and prints figures.

    1. latency p50/p95/p99 and throughput for 100, 1,000 and 5,000 candidates (concurrent keep-alive clients);
    2. in process, side by side: the shared-K/V path vs recomputing the user side per candidate (same model,
       same inputs; ``serving.scorer``);
    3. a bounded load at a target rate (default 60 s): server errors and the server's RSS growth.

Usage (a bench world: 6,000 ads, the default ranker width, 64 recent events, its own server):
    .venv/bin/python bench/serve.py --build-world /tmp/gemflow-bench
or against a server you started (``gemflow serve``): ``--url http://127.0.0.1:8080 --model-uri PATH --pid PID``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import httpx
import numpy as np
import psutil
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "gem-ranker"


def percentiles(ms: list[float]) -> str:
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return f"p50 {p50:7.2f} ms  p95 {p95:7.2f} ms  p99 {p99:7.2f} ms"


def request_body(rng, users, num_ads: int, n: int, request_ts: float) -> bytes:
    cands = rng.choice(num_ads, size=n, replace=False).tolist()
    body = {"user_id": int(rng.choice(users)), "candidates": cands, "context": {"request_ts": request_ts}}
    return json.dumps(body).encode()


def run_latency(url, bodies: list[bytes], concurrency: int) -> tuple[list[float], list[float], int, float]:
    """Each worker owns a keep-alive client; returns client ms, server score ms, errors and wall seconds."""
    lock, client_ms, score_ms, errors = threading.Lock(), [], [], [0]
    chunks = [bodies[i::concurrency] for i in range(concurrency)]

    def worker(chunk):
        with httpx.Client(timeout=30, headers={"content-type": "application/json"}) as c:
            for body in chunk:
                t0 = time.perf_counter()
                r = c.post(url, content=body)
                took = 1e3 * (time.perf_counter() - t0)
                with lock:
                    if r.status_code != 200:
                        errors[0] += 1
                        continue
                    client_ms.append(took)
                    score_ms.append(r.json()["timing_ms"]["score"])

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, chunks))
    return client_ms, score_ms, errors[0], time.perf_counter() - t0


def run_load(
    url, rng, users, num_ads, n, rate: float, seconds: float, pid: int | None, request_ts: float
) -> None:
    """Open loop at ``rate`` requests/s for ``seconds`` (bounded; stops by itself)."""
    proc = psutil.Process(pid) if pid else None
    rss0 = proc.memory_info().rss if proc else 0
    total = int(rate * seconds)
    bodies = [request_body(rng, users, num_ads, n, request_ts) for _ in range(min(total, 500))]
    lock, ms, codes = threading.Lock(), [], {}
    local = threading.local()

    def one(i):
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=10, headers={"content-type": "application/json"})
        t0 = time.perf_counter()
        try:
            code = local.client.post(url, content=bodies[i % len(bodies)]).status_code
        except httpx.HTTPError as err:
            code = type(err).__name__
        with lock:
            ms.append(1e3 * (time.perf_counter() - t0))
            codes[code] = codes.get(code, 0) + 1

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for i in tqdm(
            range(total), desc=f"load {rate:.0f} req/s x {seconds:.0f} s", leave=False, disable=None
        ):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, i)
    wall = time.perf_counter() - start
    server_errors = sum(v for k, v in codes.items() if not (isinstance(k, int) and k < 500))
    rss1 = proc.memory_info().rss if proc else 0
    print(f"  sent {total} in {wall:.1f} s ({total / wall:.1f} req/s achieved), status counts {codes}")
    print(f"  latency {percentiles(ms)}; server errors (5xx or transport): {server_errors}")
    if proc:
        print(
            f"  server RSS {rss0 / 2**20:.0f} MiB -> {rss1 / 2**20:.0f} MiB ({(rss1 - rss0) / 2**20:+.1f} MiB)"
        )


def shared_vs_recompute(model_uri: str, sizes: list[int], reps: int) -> None:
    import torch

    from models.data import Candidates, Events, Profile
    from serving.model_source import load_served_model
    from serving.scorer import UserInputs, score_recompute, score_shared

    torch.set_num_threads(1)
    served = load_served_model(model_uri)
    cfg, ranker = served.cfg, served.ranker
    vocab = {
        n: t.shape[0] - 1
        for n, t in ((f, ranker.sparse.table(f)) for f in ("ad_id", "action", "category_id", "advertiser_id"))
    }
    g = torch.Generator().manual_seed(0)
    e = cfg.recent_events
    events = Events(*(torch.randint(0, vocab[f], (e,), generator=g) for f in ("ad_id", "action")),
                    torch.zeros(e, dtype=torch.int64), torch.randint(0, vocab["category_id"], (e,), generator=g),
                    torch.randint(0, vocab["advertiser_id"], (e,), generator=g), torch.arange(e) * 60,
                    torch.randint(0, cfg.time_buckets, (e,), generator=g), torch.tensor([0, e]))  # fmt: skip
    profile = Profile(torch.tensor([1]), torch.tensor([1]), torch.tensor([1]), torch.tensor([[0.0]]))
    tokens = None
    if ranker.user_proj is not None:
        tokens = torch.randn(1, cfg.num_user_tokens, ranker.user_proj.in_features, generator=g)
    user = UserInputs(events, profile, tokens)
    print(
        f"  model {served.version}: d_model {cfg.d_model}, {cfg.num_layers} blocks, {e} recent events, torch threads 1"
    )
    for n in sizes:
        cands = Candidates(torch.randint(0, vocab["ad_id"], (n,), generator=g), torch.zeros(n, dtype=torch.int64),
                           torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                           torch.randn(n, len(served.dense.columns), generator=g), torch.tensor([0, n]))  # fmt: skip
        score_shared(ranker, user, cands, 2048)
        t_shared = min(_timed(lambda c=cands: score_shared(ranker, user, c, 2048)) for _ in range(reps))
        r = max(1, reps // 3) if n >= 1000 else reps
        t_re = min(_timed(lambda c=cands: score_recompute(ranker, user, c)) for _ in range(r))
        diff = np.abs(score_shared(ranker, user, cands, 2048) - score_recompute(ranker, user, cands)).max()
        print(f"  {n:>5} candidates: shared K/V {t_shared:8.2f} ms   recompute per candidate {t_re:9.2f} ms   "
              f"speed-up {t_re / t_shared:6.1f}x   max |diff| {diff:.1e}")  # fmt: skip


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def start_server(
    world_dir: Path, port: int, max_candidates: int, d_model: int
) -> tuple[subprocess.Popen, Path, list[int], int]:
    from tests.serving.world import KNOWN_USERS, build_world

    world_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"building a bench world in {world_dir} (6,000 ads, ranker d_model {d_model}, 64 recent events) ..."
    )
    world = build_world(world_dir, num_ads=6000, d_model=d_model, max_recent=64)
    cmd = [sys.executable, "-m", "gemflow.cli", "serve", "--workspace", str(world.ws.root),
           "--model-uri", str(world.model_path), "--http-port", str(port),
           "--set", f"limits.max_candidates={max_candidates}"]  # fmt: skip
    log = open(world_dir / "serve.log", "wb")  # noqa: SIM115 (the server process owns it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, world.model_path, list(KNOWN_USERS), 6000


def wait_ready(base: str, proc: subprocess.Popen | None, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/v2/models/{MODEL}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server at {base} not ready within {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="", help="base URL of a running server (127.0.0.1 only)")
    ap.add_argument("--build-world", type=Path, help="build a bench world here and start its server")
    ap.add_argument("--model-uri", default="", help="the served model (for the in-process comparison)")
    ap.add_argument("--pid", type=int, default=0, help="server pid (RSS growth)")
    ap.add_argument("--users", default="0,1,2,3,4", help="user ids to sample")
    ap.add_argument("--num-ads", type=int, default=6000, help="candidates are sampled from ids [0, num_ads)")
    ap.add_argument("--requests", type=int, default=300, help="requests per candidate-set size")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--sizes", default="100,1000,5000")
    ap.add_argument("--rate", type=float, default=100.0, help="target requests/s of the load phase")
    ap.add_argument("--load-seconds", type=float, default=60.0)
    ap.add_argument("--load-candidates", type=int, default=1000)
    ap.add_argument("--d-model", type=int, default=64, help="ranker width of the --build-world model")
    args = ap.parse_args()

    proc = None
    users = [int(u) for u in args.users.split(",")]
    if args.build_world:
        port = 18080
        proc, model_path, users, args.num_ads = start_server(args.build_world, port, 5000, args.d_model)
        args.url, args.model_uri, args.pid = f"http://127.0.0.1:{port}", str(model_path), proc.pid
    host = urllib.parse.urlparse(args.url).hostname
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit(
            f"--url must point at 127.0.0.1 (got {args.url!r}): this bench only drives a local server"
        )
    from tests.serving.world import REQUEST_TS

    request_ts = float(REQUEST_TS)
    try:
        wait_ready(args.url, proc)
        url = f"{args.url}/v1/models/{MODEL}:predict"
        rng = np.random.default_rng(0)
        print(
            f"\n== latency over HTTP ({args.concurrency} concurrent keep-alive clients, {args.requests} requests each size)"
        )
        for n in [int(s) for s in args.sizes.split(",")]:
            bodies = [request_body(rng, users, args.num_ads, n, request_ts) for _ in range(args.requests)]
            run_latency(url, bodies[:20], args.concurrency)  # warm-up
            ms, score, errors, wall = run_latency(url, bodies, args.concurrency)
            print(f"  {n:>5} candidates: {percentiles(ms)}  {len(ms) / wall:7.1f} req/s  "
                  f"(server scoring p50 {np.median(score):.2f} ms, errors {errors})")  # fmt: skip
        if args.model_uri:
            print("\n== shared K/V vs per-candidate recompute (in process, same model and inputs)")
            shared_vs_recompute(args.model_uri, [int(s) for s in args.sizes.split(",")], reps=5)
        print(
            f"\n== load: {args.rate:.0f} req/s x {args.load_seconds:.0f} s, {args.load_candidates} candidates"
        )
        run_load(url, rng, users, args.num_ads, args.load_candidates, args.rate, args.load_seconds,
                 args.pid or None, request_ts)  # fmt: skip
        stats = httpx.get(f"{args.url}/v2/models/{MODEL}/stats", timeout=5).json()["stats"]
        print(f"  server stats: {stats}")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    main()
