"""The data plane's two engines side by side: the training set's stages (or the ingestion) on synthetic logs.

    .venv/bin/python bench/data_plane.py [--stage training-set|ingest] [--sizes 1000000 10000000 50000000]
                                         [--engines local spark] [--days 4] [--local-memory-gb 12]
                                         [--driver-memory 6g] [--record]

``--stage ingest``: one raw day of ``size`` events from the demo's generator (``features.sources.synthetic``,
no defects) through ``gemflow ingest`` on each engine (fresh copies of the landing), stage by stage as the
ingest summary times them: raw read, gate, offline writes, derived tables, online publish (SQLite).

For each size, writes an accepted offline store (``--days`` day partitions of events + ads, contract schema,
written with the store's own writer; generated with numpy, not the behavioural generator, so the bench measures
the engines and not the simulation), then runs the training set's engine step (``features.training_sets``:
accepted-events read with the ads join, per-user histories and their file, leak-free cuts of every impression
and the examples file, vocabulary counts) once per engine, each in a fresh subprocess whose whole process tree (the JVM included) is sampled for
peak RSS every 0.1 s. Prints events/s per stage and the peak; a run that dies (the local engine is capped at
``--local-memory-gb`` of address space, the Spark driver at ``--driver-memory``) is reported as where it breaks.
Spark runs ``local[N]`` with N = the machine's cores; its session start-up is reported apart.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import add_record_flag, record  # noqa: E402

from features.feature_repo.offline import write_partition  # noqa: E402
from features.schema import ACTIONS, SCHEMAS, SURFACES  # noqa: E402
from gemflow.workspace import Workspace  # noqa: E402

START = dt.date(2026, 1, 1)
NUM_ADS = 20_000
EVENTS_PER_USER = 40


def write_store(ws: Workspace, events: int, days: int, seed: int = 0) -> None:
    """``events`` accepted events over ``days`` partitions (users = events / 40, 20k ads), ads snapshots."""
    rng = np.random.default_rng(seed)
    users = max(events // EVENTS_PER_USER, 1)
    base = pd.Timestamp(dt.datetime.combine(START, dt.time()), tz="UTC")
    ads = pd.DataFrame(
        {
            "ad_id": np.arange(NUM_ADS, dtype=np.int64),
            "advertiser_id": np.arange(NUM_ADS, dtype=np.int64) // 20,
            "category_id": (np.arange(NUM_ADS) % 50).astype(np.int32),
            "categories": [[int(c)] for c in np.arange(NUM_ADS) % 50],
            "quality": rng.random(NUM_ADS).astype(np.float32),
            "created_ts": base - pd.Timedelta(days=30),
        }
    )
    per_day = np.full(days, events // days)
    per_day[: events % days] += 1
    next_id = 0
    for k, n in enumerate(per_day):
        day = START + dt.timedelta(days=k)
        offsets_us = np.sort(rng.integers(0, 86_400_000_000, n))
        action = np.where(rng.random(n) < 0.5, 0, rng.integers(3, len(ACTIONS), n))
        click = ((action == 0) & (rng.random(n) < 0.05)).astype(np.int8)
        frame = pd.DataFrame(
            {
                "event_id": np.arange(next_id, next_id + n, dtype=np.int64),
                "user_id": rng.integers(0, users, n, dtype=np.int64),
                "ad_id": rng.integers(0, NUM_ADS, n, dtype=np.int64),
                "action": np.asarray(ACTIONS, dtype=object)[action],
                "surface": np.asarray(SURFACES, dtype=object)[rng.integers(0, len(SURFACES), n)],
                "ts": base + pd.Timedelta(days=k) + pd.to_timedelta(offsets_us, unit="us"),
                "click": click,
                "conversion": (click.astype(bool) & (rng.random(n) < 0.2)).astype(np.int8),
            }
        )
        next_id += n
        for table, df in (("events", frame), ("ads", ads)):
            write_partition(
                ws.offline(table, day), pa.Table.from_pandas(df, schema=SCHEMAS[table], preserve_index=False)
            )
        del frame


def run_engine(ws: Workspace, engine: str, days: int) -> dict[str, float]:
    """The training set's engine step, stage by stage, with its two files written under a scratch folder
    (runs inside the measured subprocess)."""
    from features import training_sets as ts
    from features.spark.session import SparkConfig

    end = START + dt.timedelta(days=days - 1)
    cfg = ts.TrainingSetConfig(name="bench", engine=engine, join_features=False)
    all_days = [START + dt.timedelta(days=k) for k in range(days)]
    out = ws.root / "bench-training-set"
    out.mkdir(exist_ok=True)
    timings: dict[str, float] = {}

    def timed(name, fn, *args, **kwargs):
        print(f"{STAGE_MARK}{name}", file=sys.stderr, flush=True)  # where a run that dies was
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        timings[name] = time.perf_counter() - t0
        return result

    if engine == "local":
        from features.histories import build_histories
        from features.stats import read_events

        events = timed("read + ads join", read_events, ws, all_days)

        def histories_file():
            histories = build_histories(events)
            ts.write_table_file(histories.to_arrow(), out / "sequences.parquet")
            return histories

        histories = timed("histories", histories_file)

        def examples_file():
            examples = ts.build_examples(events, histories, START, end, cfg)
            ts.write_table_file(ts.examples_table(examples), out / "examples.parquet")
            return examples

        examples = timed("examples (cuts)", examples_file)
        period = ts.training_period(events, examples, end, cfg)
        timed("vocabulary", ts.build_vocabularies, period, cfg.vocabulary)
    else:
        from features.spark import training_sets as st
        from features.spark.offline_read import read_events
        from features.spark.session import spark_session

        spark = timed("session start", spark_session, SparkConfig(master=f"local[{os.cpu_count()}]", **SPARK))
        scratch = ws.root / st.SCRATCH
        events = read_events(spark, ws, all_days).persist()
        timed("read + ads join", events.count)
        timed("histories", st.write_histories, events, out / "sequences.parquet", scratch)
        _, parts = timed(
            "examples (cuts)", st.write_examples, events, START, end, cfg, out / "examples.parquet", scratch
        )
        before = ts.first_held_out_day(end, cfg)
        timed("vocabulary", st.period_counts, events, before_day=before, held_out=None)
        shutil.rmtree(parts, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return timings


SPARK: dict = {}


def land_raw(ws: Workspace, events: int) -> None:
    """One raw day of ~``events`` events from the demo's generator (clicks/conversions add ~6%)."""
    from features.sources.synthetic import SyntheticConfig, generate

    users = max(1, events // EVENTS_PER_USER)
    cfg = SyntheticConfig(
        num_users=users, num_ads=NUM_ADS, days=1, start_date=START.isoformat(),
        events_per_user_day=EVENTS_PER_USER / 1.06,
    )  # fmt: skip
    generate(cfg, ws, progress=False)


def run_ingest(ws: Workspace, engine: str) -> dict[str, float]:
    """``gemflow ingest`` of the landed day on ``engine``: its summary's step timings."""
    from features.ingest import IngestConfig, ingest
    from features.spark.session import SparkConfig, spark_session

    spark = SparkConfig(master=f"local[{os.cpu_count()}]", **SPARK)
    timings: dict[str, float] = {}
    if engine == "spark":  # the JVM start apart, as for the training-set step
        t0 = time.perf_counter()
        spark_session(spark)
        timings["session start"] = time.perf_counter() - t0
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # its step log names where a run that dies was
    cfg = IngestConfig(gate={"data_docs": False}, engine=engine, spark=spark)
    summary = ingest(ws, START, cfg)
    timings.update({k: v for k, v in summary["timings_s"].items() if k != "total"})
    return timings


def measure(ws: Path, engine: str, days: int, args) -> dict:
    """Run one engine in a subprocess; sample its process tree's RSS; return timings + peak (or the failure)."""
    cmd = [sys.executable, __file__, "--child", engine, "--workspace", str(ws), "--days", str(days)]
    cmd += ["--stage", args.stage]
    cmd += ["--local-memory-gb", str(args.local_memory_gb), "--driver-memory", args.driver_memory]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    root = psutil.Process(proc.pid)
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    result = {"engine": engine, "peak_gb": peak / 2**30, "wall_s": wall}
    if proc.returncode != 0:
        result["failed"] = failure(err, proc.returncode)
        return result
    result["timings"] = json.loads(out.strip().splitlines()[-1])
    return result


STAGE_MARK = "data-plane stage: "
CAUSES = ("OutOfMemoryError", "MemoryError", "Exception:", "Error:")


def failure(stderr: str, returncode: int) -> str:
    """Where a run died and why: its last stage (our marks, or the ingest's own step log) and the first line
    naming an error (Spark logs pages of consequences after the cause), else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    steps = (re.search(rf"{STAGE_MARK}(.+)$|ingest: (.+) \.\.\.$", line) for line in lines)
    stages = [m.group(1) or m.group(2) for m in steps if m]
    causes = [line for line in lines if any(c in line for c in CAUSES) and " WARN " not in line]
    if returncode < 0:  # SIGKILL at a high peak: the kernel's OOM killer
        cause = f"killed by signal {-returncode}" + (f"; {causes[0]}" if causes else "")
    else:
        cause = (causes or lines[-1:] or [f"exit {returncode}"])[0]
    return (f"in {stages[-1]}: " if stages else "") + cause[:200]


def child(args) -> None:
    if args.child == "local":
        cap = int(args.local_memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    SPARK["driver_memory"] = args.driver_memory
    SPARK["shuffle_partitions"] = 4 * (os.cpu_count() or 1)
    ws = Workspace(args.workspace)
    timings = run_ingest(ws, args.child) if args.stage == "ingest" else run_engine(ws, args.child, args.days)
    print(json.dumps(timings))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000, 50_000_000])
    parser.add_argument("--engines", nargs="+", choices=("local", "spark"), default=["local", "spark"])
    parser.add_argument("--stage", choices=("training-set", "ingest"), default="training-set")
    parser.add_argument("--days", type=int, default=4)
    parser.add_argument("--local-memory-gb", type=float, default=12.0)
    parser.add_argument("--driver-memory", default="6g")
    parser.add_argument("--workspace", type=Path, help="Keep the data here (default: a temporary folder).")
    parser.add_argument("--child", choices=("local", "spark"), help=argparse.SUPPRESS)
    add_record_flag(parser)
    args = parser.parse_args()
    if args.child:
        return child(args)

    load = os.getloadavg()
    rows: list[tuple[str, str]] = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="gemflow-data-plane-") as tmp:
            root = args.workspace / f"events-{size}" if args.workspace else Path(tmp)
            t0 = time.perf_counter()
            if args.stage == "ingest":
                land_raw(Workspace(root / "landing"), size)
                print(f"\n{size:,} raw events of one day landed in {time.perf_counter() - t0:.1f} s")
            else:
                write_store(Workspace(root), size, args.days)
                print(f"\n{size:,} events over {args.days} days written in {time.perf_counter() - t0:.1f} s")
            for engine in args.engines:
                target = root
                if args.stage == "ingest":  # each engine ingests its own copy of the landing
                    target = root / engine
                    shutil.rmtree(target, ignore_errors=True)
                    shutil.copytree(root / "landing", target)
                res = measure(target, engine, args.days, args)
                label = f"{engine}, {size / 1e6:g}M events"
                if "failed" in res:
                    print(
                        f"  {engine:<6} FAILED after {res['wall_s']:.0f} s, peak {res['peak_gb']:.2f} GB: {res['failed']}"
                    )
                    rows.append((label, f"breaks: {res['failed'][:120]} (peak {res['peak_gb']:.1f} GB)"))
                    continue
                stages = {k: v for k, v in res["timings"].items() if k != "session start"}
                total = sum(stages.values())
                for name, seconds in res["timings"].items():
                    rate = "" if name == "session start" else f"{size / seconds:>12,.0f} events/s"
                    print(f"  {engine:<6} {name:<18} {seconds:8.2f} s {rate}")
                print(
                    f"  {engine:<6} {'all stages':<18} {total:8.2f} s {size / total:>12,.0f} events/s, peak {res['peak_gb']:.2f} GB"
                )
                per_stage = ", ".join(f"{k} {size / v / 1e3:,.0f}k/s" for k, v in stages.items())
                rows.append(
                    (
                        label,
                        f"{size / total:,.0f} events/s ({total:.0f} s), peak {res['peak_gb']:.2f} GB; {per_stage}",
                    )
                )
    print(
        f"load average before the run {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} on {os.cpu_count()} cores"
    )
    if args.record:
        rows.append(
            ("load average before the run (1/5/15 min)", f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
        )
        sizes = "-".join(f"{size / 1e6:g}m" for size in args.sizes)
        stage = "" if args.stage == "training-set" else f"{args.stage}."
        key = f"data-plane.{stage}{sizes}.{'-'.join(args.engines)}"  # one section per size/engine set
        record(
            key,
            f"{args.stage} stages, local vs Spark engine (bench/data_plane.py --stage {args.stage})",
            rows,
        )


if __name__ == "__main__":
    main()
