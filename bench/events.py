"""Load bench of the live event path: event-to-visible latency and exactly-once counts, with the ranker under load.

Builds the serving bench world (``bench/serve.py``'s: 6,000 ads, the default ranker, SQLite online store), lands
an ads snapshot for today (what a live lander does first), starts the ranker (``gemflow serve``) and the collector
(``gemflow events serve``) on it, then for ``--seconds``:
- an open loop posts ``--rate`` events/s to ``POST /v1/events`` in batches of ``--batch`` (the ad server's
  reporter batches; one event per request is ``--batch 1``), users drawn from ``--users`` ids (the ranked bench
  users among them), every event stamped now;
- a second open loop sends ``--rank-rate`` ranking requests/s of ``--candidates`` candidates to the ranker
  (``bench/serve.py``'s soak: it prints its own latency line);
- a prober reads the online store (Feast's ``online_read``, as serving does) every ``--probe-ms`` for one sampled
  event of each acknowledged batch: event-to-visible latency = first read that holds it - the send time.
Then it waits for the raw-log export and prints: events sent / acknowledged (200) / visible online / in the raw
log (each event id once), lost and duplicated counts, visible p50/p99, the collector's CPU per event and the CPU
model. The whole machine is shared by the ranker, the collector and this client (on a 2-core box: all three
compete, and with other engineers' jobs): read the figures with the load average it prints.

Usage:  .venv/bin/python bench/events.py --world /tmp/gemflow-events-bench [--seconds 60 --rate 2000]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
import pandas as pd
import psutil
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import add_record_flag, record  # noqa: E402
from bench.serve import Client, cpu_model, percentiles, run_soak, start_server, wait_ready  # noqa: E402


def land_ads_snapshot(ws) -> None:
    """Today's ads snapshot in the raw contract, from the bench world's ad attributes (the collector reads it)."""
    from features.feature_repo.offline import read_days
    from features.schema import ADS_SCHEMA

    attrs = read_days(ws, "ad_attributes", [dt.date(2026, 3, 2)])
    today = dt.datetime.now(dt.UTC).date()
    ads = pd.DataFrame(
        {
            "ad_id": attrs["ad_id"].astype(np.int64),
            "advertiser_id": attrs["ad_advertiser_id"].astype(np.int64),
            "category_id": attrs["ad_category_id"].astype(np.int32),
            "categories": [[int(c)] for c in attrs["ad_category_id"]],
            "quality": attrs["ad_quality"].astype(np.float32),
            "created_ts": pd.Timestamp("2026-01-01", tz="UTC"),
        }
    )
    folder = ws.raw("ads", today)
    folder.mkdir(parents=True, exist_ok=True)
    import pyarrow as pa

    pq.write_table(pa.Table.from_pandas(ads, schema=ADS_SCHEMA, preserve_index=False), folder / "ads.parquet")


def start_collector(ws_root: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gemflow.cli", "events", "serve", "-w", str(ws_root), "--port", str(port),
           "--set", "export_every_s=2"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115


def wait_collector(base: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"collector exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit("collector not ready")


class Prober:
    """Polls the online store for sampled (user, event id, sent at) until each is visible."""

    def __init__(self, ws, probe_s: float):
        from features.feature_repo import FeatureStoreConfig
        from features.store import open_store

        self.store = open_store(ws, FeatureStoreConfig())
        self.view = self.store.get_feature_view("user_recent_events")
        self.online = self.store._get_provider().online_store
        self.probe_s = probe_s
        self.waiting: dict[int, tuple[int, float]] = {}  # event id -> (user, sent at)
        self.latency_ms: list[float] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def add(self, user: int, event_id: int, sent: float) -> None:
        with self.lock:
            self.waiting[event_id] = (user, sent)

    def visible_ids(self, users: list[int]) -> set[int]:
        """The event ids in the online lists of ``users``: Feast's ``online_read`` (serving's call), only the ids
        decoded (the bench shares the machine with what it measures: its prober must stay light)."""
        from feast.protos.feast.types.EntityKey_pb2 import EntityKey
        from feast.protos.feast.types.Value_pb2 import Value

        keys = [EntityKey(join_keys=["user_id"], entity_values=[Value(int64_val=u)]) for u in users]
        rows = self.online.online_read(self.store.config, self.view, keys, ["recent_event_ids"])
        ids: set[int] = set()
        for _, values in rows:
            if values and "recent_event_ids" in values:
                ids.update(values["recent_event_ids"].int64_list_val.val)
        return ids

    def run(self) -> None:
        while not (self.done.is_set() and not self.waiting):
            with self.lock:
                waiting = dict(self.waiting)
            if waiting:
                users = sorted({u for u, _ in waiting.values()})
                found = self.visible_ids(users)
                now = time.perf_counter()
                seen = found & waiting.keys()
                with self.lock:
                    for event_id in seen:
                        _, sent = self.waiting.pop(event_id)
                        self.latency_ms.append(1e3 * (now - sent))
            time.sleep(self.probe_s)


def run_events(base, rate, seconds, batch, users, num_ads, prober, first_id) -> dict:
    rng = np.random.default_rng(1)
    total = int(rate * seconds)
    posts = (total + batch - 1) // batch
    tally, acked, local = Counter(), [], threading.local()
    lock = threading.Lock()
    next_id = iter(range(first_id, first_id + total))

    def one(due: float) -> None:
        if not hasattr(local, "client"):
            local.client = Client(base, timeout=10)
        with lock:
            ids = [next(next_id) for _ in range(batch)]
            user = rng.choice(users, size=batch).tolist()
            ads = rng.integers(0, num_ads, size=batch).tolist()
        now = dt.datetime.now(dt.UTC).isoformat()
        events = [{"event_id": i, "user_id": u, "ad_id": a, "action": "click" if i % 10 == 0 else "impression",
                   "surface": "feed", "ts": now, "click": 0, "conversion": 0}
                  for i, u, a in zip(ids, user, ads, strict=True)]  # fmt: skip
        sent = time.perf_counter()
        try:
            status, _ = local.client.post("/v1/events", orjson.dumps({"events": events}))
        except OSError as err:
            status = type(err).__name__
        with lock:
            tally[status] += 1
            if status == 200:
                acked.extend(ids)
        if status == 200:
            prober.add(user[0], ids[0], sent)  # visible: this read sees it; sent: before the POST

    start, futures = time.perf_counter(), []
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        for k in range(posts):
            due = start + k * batch / rate
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            futures.append(pool.submit(one, due))
    wall = time.perf_counter() - start
    for f in futures:
        f.result()  # a client-side error is the bench's bug: raise it
    return {"sent": posts * batch, "posts": posts, "acked": acked, "codes": dict(tally), "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=Path, required=True, help="folder for the bench world (built if absent)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=2000.0, help="events/s")
    ap.add_argument("--batch", type=int, default=20, help="events per POST")
    ap.add_argument("--users", type=int, default=10_000, help="event users are drawn from ids [0, users)")
    ap.add_argument("--rank-rate", type=float, default=100.0, help="ranking requests/s (0: no ranker load)")
    ap.add_argument("--candidates", type=int, default=1000)
    ap.add_argument("--probe-ms", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=18080, help="ranker port (the collector takes port + 10)")
    add_record_flag(ap)
    args = ap.parse_args()

    ranker, _, ws_root, rank_users, num_ads = start_server(args.world, args.port, 5000, 64, False)
    from gemflow.workspace import Workspace
    from serving.events.export import LIVE_TABLE
    from tests.serving.world import REQUEST_TS

    ws = Workspace(ws_root)
    land_ads_snapshot(ws)
    import shutil

    for leftover in (ws.root / "events", ws.raw(LIVE_TABLE)):  # a previous run's log: ids would collide
        shutil.rmtree(leftover, ignore_errors=True)
    collector_url = f"http://127.0.0.1:{args.port + 10}"
    collector = start_collector(ws_root, args.port + 10, args.world / "collector.log")
    rank_url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(rank_url, ranker)
        wait_collector(collector_url, collector)
        print(f"{os.cpu_count()} CPUs ({cpu_model()}), load average "
              f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}; ranker pid {ranker.pid}, "
              f"collector pid {collector.pid}")  # fmt: skip
        prober = Prober(ws, args.probe_ms / 1000)
        prober.thread.start()
        users = np.unique(np.concatenate([np.arange(args.users), rank_users])).astype(np.int64)
        cproc = psutil.Process(collector.pid)
        cpu0 = sum(cproc.cpu_times()[:2])
        rank_thread = None
        if args.rank_rate > 0:
            rank_thread = threading.Thread(
                target=run_soak,
                args=(
                    rank_url,
                    np.random.default_rng(0),
                    rank_users,
                    num_ads,
                    args.candidates,
                    args.rank_rate,
                    args.seconds,
                    psutil.Process(ranker.pid),
                    float(REQUEST_TS),
                ),  # fmt: skip
            )
            rank_thread.start()
        print(f"\n== events: {args.rate:.0f} events/s x {args.seconds:.0f} s in batches of {args.batch}, "
              f"{len(users)} users")  # fmt: skip
        out = run_events(collector_url, args.rate, args.seconds, args.batch, users, num_ads, prober, 10**12)
        cpu = sum(cproc.cpu_times()[:2]) - cpu0
        if rank_thread is not None:
            rank_thread.join()
        prober.done.set()
        prober.thread.join(60)
        acked = out["acked"]
        # visible: every acknowledged event in its user's online list (lists hold the newest 64; the users'
        # share of 2,000 events/s stays well under that)
        from features.recent_events import read_online

        found, _ = read_online(prober.store, users.tolist())
        visible = len(set(found["event_id"].tolist()) & set(acked))
        deadline = time.monotonic() + 60
        while True:
            files = sorted(ws.raw(LIVE_TABLE).glob("date=*/*.parquet"))
            logged = (
                pd.concat([pq.read_table(f, columns=["event_id"]).to_pandas() for f in files])
                if files
                else None
            )
            in_log = 0 if logged is None else len(logged)
            if in_log >= len(acked) or time.monotonic() > deadline:
                break
            time.sleep(1)
        ids = Counter(logged["event_id"].tolist()) if logged is not None else Counter()
        print(f"  sent {out['sent']} events in {out['posts']} POSTs over {out['wall']:.1f} s "
              f"({out['sent'] / out['wall']:.0f} events/s); POST status counts {out['codes']}")  # fmt: skip
        print(f"  acknowledged {len(acked)}, visible online {visible}, in the raw log {len(set(ids) & set(acked))}"
              f" (rows {in_log}); lost {len(set(acked) - set(ids))} (raw log) / {len(acked) - visible} (online),"
              f" duplicated {sum(c - 1 for c in ids.values() if c > 1)}")  # fmt: skip
        print(
            f"  event -> visible online: {percentiles(prober.latency_ms)} ({len(prober.latency_ms)} sampled)"
        )
        print(
            f"  collector CPU {1e3 * cpu / max(len(acked), 1):.3f} ms/event ({cpu / out['wall']:.2f} cores)"
        )
        if args.record:
            lost = len(set(acked) - set(ids)) + len(acked) - visible
            duplicated = sum(c - 1 for c in ids.values() if c > 1)
            p50, p99 = (
                np.percentile(prober.latency_ms, [50, 99]) if prober.latency_ms else (float("nan"),) * 2
            )
            load = f"{args.rate:.0f} events/s offered x {args.seconds:.0f} s, batches of {args.batch}"
            load += (
                f", ranker {args.rank_rate:.0f} req/s x {args.candidates}"
                if args.rank_rate > 0
                else ", no ranker"
            )
            rows = [
                (f"events absorbed ({load})", f"{out['sent'] / out['wall']:.0f} events/s"),
                ("sent = acknowledged = visible online = in the raw log",
                 f"{out['sent']:,} = {len(acked):,} = {visible:,} = {len(set(ids) & set(acked)):,}"),
                ("lost / duplicated", f"{lost} / {duplicated}"),
                ("event -> visible online p50 / p99", f"{p50:.0f} / {p99:.0f} ms"),
                ("collector CPU per event", f"{1e3 * cpu / max(len(acked), 1):.2f} ms"),
                ("load average at the end (1 min)", f"{os.getloadavg()[0]:.1f}"),
            ]  # fmt: skip
            if rank_thread is not None:
                from bench.serve import FIGURES

                rows.append(
                    ("ranker at the same time: latency, degraded, server CPU per request", FIGURES[-1][1])
                )
            # one section per configuration: a lighter run does not replace the full-load one
            config = (args.rate, args.seconds, args.batch, args.rank_rate, args.candidates)
            key = "events" if config == (2000, 60, 20, 100, 1000) else f"events.{args.rate:.0f}-per-s"
            key += "" if key == "events" or args.rank_rate > 0 else ".no-ranker"
            record(key, f"live event path (bench/events.py), {load}", rows)
    finally:
        for proc in (collector, ranker):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    main()
