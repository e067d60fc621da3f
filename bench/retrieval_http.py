"""End to end over HTTP: retrieve 1,000 from a 1M-ad index + rank them, open loop, as a client sees it.

    # once: the world (1,000,000 ads in the ad table and the index, d = the user model's width), cached on disk
    .venv/bin/python bench/retrieval_http.py prepare --world /tmp/gemflow-retrieval-world
    # the two 60 s runs (all surfaces eligible; a surface that 10% of the catalog may show on), recorded
    .venv/bin/python bench/retrieval_http.py run --world /tmp/gemflow-retrieval-world --rate 100 --seconds 60 --record

``prepare`` builds a serving world (``tests.serving.world.build_world``: Feast offline tables + a materialized
SQLite online store for every ad, a ranker at d_model 64), then what a refresh writes (``offline/retrieval/D``,
``tests.serving.world.write_retrieval_folder``): a next-item user model of ``configs/sequential.yaml``'s shape
whose ad rows are clustered vectors (the structure of a trained catalog), its record, its ad vectors and its users'
queries; an ``ad_serving`` table in which every ad may show on
``feed`` and 10% of them on ``stories``, then runs ``gemflow retrieval-index`` once: the IVF build is written
beside the vectors and the server maps it (``serving.retrieval.index_files``). A second ``prepare`` finds the
world ready and does nothing. ``run`` starts ``gemflow serve`` on it (retrieval on, K 1,000), then per surface an
open loop at ``--rate`` for ``--seconds``: client latency p50/p95/p99 (from when each request was due), status
counts, server CPU per request (the server and its child processes, from /proc), the retrieval stage's own ms
and which query each answer used (fresh: the recorded user model over the events the request read). The load average is printed and recorded beside the figures: on a shared machine they move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import add_record_flag, record  # noqa: E402
from retrieval import ROOT, clustered  # noqa: E402
from serve import Client, cpu_seconds, percentiles, send_open_loop, wait_ready  # noqa: E402

MODEL = "gem-ranker"
PREDICT = f"/v1/models/{MODEL}:predict"
READY = "ready.json"
SURFACES_RUN = (("feed", "every ad eligible"), ("stories", "filter excluding 90% of the catalog"))


def prepare(world_dir: Path, ads: int) -> dict:
    import psutil  # noqa: F401 (the run needs it; fail early)
    import yaml

    from features.feature_repo.offline import write_partition
    from features.schema import SURFACES
    from features.stats import ad_serving_table
    from models.config import UserModelConfig
    from models.embeddings.ad_vectors import RETRIEVAL_TABLE
    from tests.serving.world import DAY, HEALTHY_USERS, build_world, write_retrieval_folder

    marker = world_dir / READY
    if marker.exists():
        info = json.loads(marker.read_text())
        print(f"world ready in {world_dir} ({info['ads']:,} ads): nothing to do")
        return info
    import pandas as pd

    t0 = time.perf_counter()
    world = build_world(world_dir, num_ads=ads, d_model=64, max_recent=64)
    print(f"serving world ({ads:,} ads, materialized) in {time.perf_counter() - t0:.0f} s", flush=True)
    # the user model of configs/sequential.yaml (untrained: latency does not depend on the weights), its ad rows
    # set to clustered vectors so the index searches the structure of a trained catalog
    shape = yaml.safe_load((ROOT / "configs" / "sequential.yaml").read_text())["user_model"]
    cfg = UserModelConfig(**shape, objective="next_item", item_attributes="none")
    vectors = clustered(ads, cfg.d_model, 2000, 1)
    model_path = world_dir / "user-model" / "model.pt"
    write_retrieval_folder(world, world.ws.offline(RETRIEVAL_TABLE, DAY), model_path, cfg, 0, vectors)
    users = np.array(HEALTHY_USERS, np.int64)
    on_stories = np.random.default_rng(7).random(ads) < 0.10
    everywhere, not_stories = list(SURFACES), [s for s in SURFACES if s != "stories"]
    frame = pd.DataFrame({"ad_id": np.arange(ads, dtype=np.int64),
                          "created_ts": pd.Timestamp(DAY, tz="UTC"),
                          "surfaces": [everywhere if s else not_stories for s in on_stories]})  # fmt: skip
    write_partition(world.ws.offline("ad_serving", DAY), ad_serving_table(frame, DAY))
    t1 = time.perf_counter()
    cmd = [sys.executable, "-m", "gemflow.cli", "retrieval-index", "--workspace", str(world.ws.root),
           "--no-track", "--sample", "50"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    report = json.loads(out[out.index("{") :])
    print(f"index: {report['kind']} built in {report['build_seconds']:.0f} s ({time.perf_counter() - t1:.0f} s with "
          f"the recall check), {report['index_bytes'] / 2**20:.0f} MB, recall@{report['k']} "
          f"{report['recall_at_' + str(report['k'])]:.3f}", flush=True)  # fmt: skip
    info = {"ads": ads, "dim": cfg.d_model, "user_model": str(model_path), "ws": str(world.ws.root), "model": str(world.model_path),
            "users": users.tolist(), "stories_share": float(on_stories.mean()), "index": report}  # fmt: skip
    marker.write_text(json.dumps(info, indent=2))
    return info


def open_loop(base: str, bodies: list[bytes], rate: float, seconds: float, proc) -> dict:
    import psutil

    total, retrieval_ms, queries = int(rate * seconds), [], Counter()

    errors: list[str] = []  # the first few error answers, as sent

    def on_reply(status, payload) -> None:
        if status == 200:
            ret = orjson.loads(payload)["retrieval"]
            retrieval_ms.append(ret["ms"])
            queries[ret["query"]] += 1
        elif len(errors) < 3:
            errors.append(f"{status} {bytes(payload[:200]).decode(errors='replace')}")

    server = psutil.Process(proc.pid)
    cpu0 = cpu_seconds(server)
    tally, wall = send_open_loop(base, bodies, rate, total, on_reply)
    return {"sent": total, "wall": wall, "codes": dict(tally.codes), "latency": percentiles(tally.client_ms),
            "pauses": pauses(base), "first_errors": errors,
            "errors": sum(v for k, v in tally.codes.items() if k != 200),
            "cpu_ms": 1e3 * (cpu_seconds(server) - cpu0) / total,
            "retrieval": percentiles(retrieval_ms), "queries": dict(queries), "load": os.getloadavg()[0]}  # fmt: skip


def pauses(base: str) -> str:
    """The server's stop-the-world pauses of the last minute (``serving.pauses``): garbage collections and
    event-loop lag, which tell a stall from queueing when a tail or a 503 needs explaining."""
    from serving.client import get

    status, body = get(f"{base}/v2/models/{MODEL}/stats")
    if status != 200:
        return f"stats unavailable ({status})"
    p = body["pauses"]
    collections = ", ".join(f"{g} {v['count']} (max {v['max_ms']} ms)" for g, v in p["gc"].items()) or "none"
    lag = p["event_loop_lag"]
    return f"gc {collections}; event-loop lag p99 {lag.get('p99_ms')} ms, max {lag.get('max_ms')} ms"


def run(args) -> list[tuple[str, str]]:
    from tests.serving.world import REQUEST_TS

    info = json.loads((args.world / READY).read_text())
    port = args.port
    cmd = [sys.executable, "-m", "gemflow.cli", "serve", "--workspace", info["ws"], "--model-uri", info["model"],
           "--http-port", str(port), "--set", "retrieval.enabled=true", "--set", f"retrieval.index.default_k={args.k}",
           "--set", f"limits.max_candidates={max(args.k, 1000)}", "--set", "ad_table.refresh_seconds=3600"]  # fmt: skip
    log = open(args.world / "serve.log", "wb")  # noqa: SIM115 (the server process owns it)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        wait_ready(base, proc, timeout=args.ready_timeout)
        print(f"server ready in {time.perf_counter() - t0:.0f} s (pid {proc.pid})", flush=True)
        for surface, what in SURFACES_RUN:
            bodies = [orjson.dumps({"user_id": u, "retrieve": {"k": args.k},
                                    "context": {"request_ts": float(REQUEST_TS), "surface": surface}})
                      for u in info["users"]]  # fmt: skip
            status, probe = Client(base).post(PREDICT, bodies[0])
            reply = orjson.loads(probe)
            assert status == 200, reply
            ret = reply["retrieval"]
            print(
                f"{surface}: eligible {ret['eligible']:,}, retrieved {ret['retrieved']}, method {ret['method']}, query {ret['query']}"
            )
            for _ in range(args.warm):  # first touches of the mapped pages and the scorer's shapes
                Client(base).post(PREDICT, bodies[0])
            res = open_loop(base, bodies, args.rate, args.seconds, proc)
            print(f"  {surface} ({what}): sent {res['sent']} in {res['wall']:.1f} s, codes {res['codes']}; latency "
                  f"{res['latency']}; retrieval stage {res['retrieval']}; queries {res['queries']}; pauses {res['pauses']}; server CPU {res['cpu_ms']:.2f} ms/request; "
                  f"load {res['load']:.1f}", flush=True)  # fmt: skip
            if res["first_errors"]:
                print(f"  first errors: {res['first_errors']}", flush=True)
            rows.append((f"{info['ads']:,} ads, {surface} ({what}: {ret['eligible']:,} eligible), retrieve {args.k} "
                         f"+ rank, open loop {args.rate:.0f} req/s x {args.seconds:.0f} s: latency; errors; server CPU",
                         f"{res['latency']}; {res['errors']} errors of {res['sent']}; {res['cpu_ms']:.2f} ms/request "
                         f"(retrieval stage {res['retrieval']}; queries {res['queries']}; "
                         f"load average {res['load']:.1f})"))  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    idx = info["index"]
    rows.append(("index (built once by gemflow retrieval-index, mapped by the server): kind, build, size, recall",
                 f"{idx['kind']}, {idx['build_seconds']:.0f} s, {idx['index_bytes'] / 2**20:.0f} MB, "
                 f"recall@{idx['k']} {idx['recall_at_' + str(idx['k'])]:.3f}"))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("prepare", "run"))
    ap.add_argument("--world", type=Path, default=Path("/tmp/gemflow-retrieval-world"))
    ap.add_argument("--ads", type=int, default=1_000_000)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--port", type=int, default=18095)
    ap.add_argument("--ready-timeout", type=float, default=1800.0)
    add_record_flag(ap)
    args = ap.parse_args()
    args.world.mkdir(parents=True, exist_ok=True)
    if args.mode == "prepare":
        prepare(args.world, args.ads)
        return
    rows = run(args)
    for figure, value in rows:
        print(f"  {figure}: {value}")
    if args.record:
        record("retrieval-http", "candidate retrieval end to end over HTTP (bench/retrieval_http.py)", rows)


if __name__ == "__main__":
    main()
