"""Ingestion throughput: synthetic generation, validation, feature derivation, materialization, end to end.

    .venv/bin/python bench/ingest.py [--events 1000000] [--days 1] [--users 50000] [--data-docs] [--workspace DIR]
                                     [--online-store sqlite|redis] [--online-writer fast|feast]

Generates about ``--events`` events over ``--days`` day partitions with ``features.sources.synthetic``, then runs
``gemflow ingest`` (``features.ingest.ingest``) for every day on the embedded defaults (DuckDB offline store,
SQLite online store, or a private redis-server the script starts and stops with ``--online-store redis``).
``--online-writer feast`` publishes through ``FeatureStore.materialize`` / ``push`` instead of the fast writer (the
"before" figures). Prints events/s per stage, the process CPU time, the load average before the run, and peak RSS.
Goal: >= 1M events per minute end to end on 2 cores, peak RSS < 4 GB.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import resource
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from report import add_record_flag, record

from features.feature_repo import FeatureStoreConfig
from features.ingest import IngestConfig, ingest
from features.sources.synthetic import SyntheticConfig, generate
from gemflow.workspace import Workspace

STAGES = {
    "validation": ("validate",),
    "offline write + derive": ("write offline", "derive features"),
    "materialize + push": ("feast apply", "materialize", "push recent events"),
    "  of which materialize": ("materialize",),
    "  of which push": ("push recent events",),
}


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (make redis)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    raise SystemExit(f"redis-server did not start on port {port}")


def run(args: argparse.Namespace, root: Path) -> None:
    redis = None
    store_cfg = FeatureStoreConfig()
    if args.online_store == "redis":
        redis, url = start_redis(root)
        store_cfg = FeatureStoreConfig(online_store="redis", redis_connection=url)
    try:
        _run(args, root, store_cfg)
    finally:
        if redis is not None:
            redis.terminate()
            redis.wait(timeout=10)


def _run(args: argparse.Namespace, root: Path, store_cfg: FeatureStoreConfig) -> None:
    ws = Workspace(root)
    per_user_day = (
        args.events / (args.users * args.days) / 1.06
    )  # clicks/conversions add ~6% to the base events
    gen_cfg = SyntheticConfig(
        num_users=args.users,
        num_ads=args.ads,
        days=args.days,
        start_date=args.start_date,
        events_per_user_day=per_user_day,
    )
    load = os.getloadavg()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    summary = generate(gen_cfg, ws, progress=True)
    generate_s = time.perf_counter() - t0
    events = int(summary.get("events") or sum(summary.get("events_per_day", {}).values()))

    cfg = IngestConfig(
        feature_store=store_cfg, gate={"data_docs": args.data_docs}, online_writer=args.online_writer
    )
    stage_s = dict.fromkeys(STAGES, 0.0)
    t1 = time.perf_counter()
    start = dt.date.fromisoformat(args.start_date)
    accepted = 0
    for k in range(args.days):
        result = ingest(ws, start + dt.timedelta(days=k), cfg)
        accepted += result["tables"]["events"]["accepted"]
        for stage, steps in STAGES.items():
            stage_s[stage] += sum(result["timings_s"].get(s, 0.0) for s in steps)
    ingest_s = time.perf_counter() - t1
    total_s = generate_s + ingest_s
    cpu_s = time.process_time() - cpu0

    def line(name: str, seconds: float) -> None:
        print(
            f"{name:<26} {seconds:8.2f} s  {events / seconds:>12,.0f} events/s  {events / seconds * 60:>14,.0f} /min"
        )

    print(
        f"\n{events:,} events over {args.days} day(s), {args.users:,} users, {accepted:,} accepted, "
        f"online store {store_cfg.online_store}, writer {args.online_writer}; load average before the run "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min) on {os.cpu_count()} cores"
    )
    line("generation", generate_s)
    for stage, seconds in stage_s.items():
        line(stage, seconds)
    line("ingest (all steps)", ingest_s)
    line("end to end", total_s)
    print(f"process CPU time {cpu_s:.2f} s (wall {total_s:.2f} s)")
    print(f"peak RSS {peak_rss_gb():.2f} GB; goal: >= 1,000,000 events/min end to end, < 4 GB")
    if args.record:
        what = f"{events:,} events, {store_cfg.online_store} online store"
        rows = [
            (f"end to end, {what}", f"{events / total_s * 60:,.0f} events/min ({total_s:.1f} s)"),
            ("peak RSS", f"{peak_rss_gb():.2f} GB"),
        ]
        record(f"ingest.{store_cfg.online_store}", "generate + ingest (bench/ingest.py)", rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=1)
    parser.add_argument("--users", type=int, default=50_000)
    parser.add_argument("--ads", type=int, default=10_000)
    parser.add_argument("--start-date", default="2026-01-01")
    parser.add_argument("--data-docs", action="store_true", help="Also render GX data docs HTML (slower).")
    parser.add_argument("--online-store", choices=("sqlite", "redis"), default="sqlite")
    parser.add_argument("--online-writer", choices=("fast", "feast"), default="fast")
    parser.add_argument("--workspace", type=Path, help="Keep the data here (default: a temporary folder).")
    add_record_flag(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.workspace:
        run(args, args.workspace.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="gemflow-bench-") as tmp:
            run(args, Path(tmp))


if __name__ == "__main__":
    main()
