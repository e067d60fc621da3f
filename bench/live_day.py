"""A live day on the demo pipeline: train = serve, checked on what the ranker actually served.

1. The demo pipeline, by the same ``gemflow`` commands its DAGs run, with the demo's configs
   (``configs/embedded-*.yaml``): 4 synthetic days landed and ingested, the user model trained, gated, its
   embeddings refreshed and backfilled, the ranker trained on a point-in-time training set and promoted
   (``register-run``, the platform's calibration bounds). Skipped where the workspace already holds it.
2. The ranker (``gemflow serve --model-uri models:/gem-ranker@champion``, every request's features logged) and
   the event collector (``gemflow events serve``) start; the next day is landed live
   (``serving.live_day``: ``gemflow land-synthetic --live``'s streamer) while each impression's user is ranked at
   the impression's own time, once the stream is ``fresh_delay_s`` (wall seconds) past it.
3. The live day is ingested from the collector's raw-log export (``gemflow ingest``), a training set is built
   through it, and ``gemflow skew-check`` holds the logged serving features against the training-set builder's.
4. The promoted ranker's NE/AUC/calibration on the live day's ranked impressions: (a) scored on the training
   set's features (what it was trained on), (b) the scores serving returned (what it served).

Usage:  .venv/bin/python bench/live_day.py --workspace /tmp/gemflow-live-day [--rate 400] [--record]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from bench.events import wait_collector  # noqa: E402
from bench.report import add_record_flag, record  # noqa: E402
from bench.serve import cpu_model, wait_ready  # noqa: E402
from gemflow.platform import champion_version  # noqa: E402
from gemflow.workspace import Workspace  # noqa: E402
from serving.events.export import LIVE_TABLE  # noqa: E402
from serving.live_day import ReplayConfig, replay_day, served_vs_trained  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GEMFLOW = [sys.executable, "-m", "gemflow.cli"]
DEMO_DAYS = 4  # the demo's backfill: train (2 days), valid, test
CALIBRATION = ("--calibration-low", "0.8", "--calibration-high", "1.25")  # configs/embedded-platform.yaml


def gemflow(ws: Path, *args: str, log: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """One ``gemflow`` stage on ``ws`` (the command line each DAG task runs), its output into ``log``."""
    cmd = [*GEMFLOW, *args, "-w", str(ws)]
    started = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}\n")
    print(
        f"  gemflow {' '.join(args)}  ({time.monotonic() - started:.0f} s, exit {out.returncode})", flush=True
    )
    if check and out.returncode != 0:
        raise SystemExit(f"gemflow {' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out


def prepare(ws: Path, epoch: dt.date, live_day: dt.date, log: Path) -> None:
    """The demo pipeline through the day before ``live_day``, each stage skipped when already done."""
    last = live_day - dt.timedelta(days=1)
    synthetic = ("-c", "configs/embedded-synthetic.yaml")
    for k in range(DEMO_DAYS):
        day = epoch + dt.timedelta(days=k)
        if not (ws / "raw" / "events" / f"date={day}").exists():
            gemflow(ws, "land-synthetic", "--date", str(day), "--epoch", str(epoch), *synthetic, log=log)
    if not (ws / "offline" / "events" / f"date={last}").exists():
        gemflow(ws, "ingest", "--start", str(epoch), "--end", str(last), log=log)
    if not (ws / "models" / "user" / "user" / "model.pt").exists():
        gemflow(ws, "build-training-set", "--name", "user", "--end", str(last), log=log)
        gemflow(ws, "train", "--model", "user", "--training-set", "user", "-c", "configs/embedded-user.yaml",
                "--set", "tracking.run_name=user", log=log)  # fmt: skip
        gemflow(ws, "register-run", "--kind", "user", "--run-dir", str(ws / "models/user/user"),
                "--training-set", "user", *CALIBRATION, log=log)  # fmt: skip
    if not (ws / "models" / "ranker" / "ranker").exists():
        gemflow(ws, "refresh-embeddings", "--model-uri", "models:/gem-user-model@champion", "--date", str(last),
                log=log)  # fmt: skip
        gemflow(ws, "backfill-embeddings", "--through", str(last), log=log)
        gemflow(ws, "build-training-set", "--name", "ranker", "--end", str(last), log=log)
        gemflow(ws, "train", "--model", "ranker", "--training-set", "ranker", "-c", "configs/embedded-ranker.yaml",
                "--set", "tracking.run_name=ranker", log=log)  # fmt: skip
        gemflow(ws, "register-run", "--kind", "ranker", "--run-dir", str(ws / "models/ranker/ranker"),
                *CALIBRATION, log=log)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workspace", type=Path, required=True, help="the demo workspace (built if absent)")
    ap.add_argument("--live-day", default="", help="the day streamed live (default: yesterday, UTC)")
    ap.add_argument(
        "--prepare-only", action="store_true", help="stop once the demo pipeline has promoted a ranker"
    )
    ap.add_argument("--rate", type=float, default=400.0, help="events/s streamed to the collector")
    ap.add_argument("--rank-rate", type=float, default=20.0, help="ranked impressions/s (every k-th one)")
    ap.add_argument("--candidates", type=int, default=100, help="candidates per ranking request")
    ap.add_argument(
        "--lag", type=float, default=1.0, help="wall seconds from an impression's batch to its ranking"
    )
    ap.add_argument(
        "--list-events",
        type=int,
        default=0,
        help="the collector's online list length (default: the platform's, features.schema.ONLINE_LIST_EVENTS)",
    )
    ap.add_argument("--port", type=int, default=18480, help="ranker port (the collector takes port + 10)")
    ap.add_argument("--json", type=Path, default=None, help="the report (default <workspace>/live_day.json)")
    add_record_flag(ap)
    args = ap.parse_args()
    live_day = (
        dt.date.fromisoformat(args.live_day)
        if args.live_day
        else dt.datetime.now(dt.UTC).date() - dt.timedelta(1)
    )
    epoch = live_day - dt.timedelta(days=DEMO_DAYS)
    ws = args.workspace.resolve()
    ws.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"== 1. the demo pipeline: {epoch} .. {live_day - dt.timedelta(1)} (workspace {ws})", flush=True)
    prepare(ws, epoch, live_day, ws / "stages.log")
    print(f"   ready in {time.monotonic() - started:.0f} s", flush=True)
    if args.prepare_only:
        return
    if champion_version(Workspace(ws), "gem-ranker") is None:
        raise SystemExit("the ranker was not promoted (see stages.log): there is no champion to serve")
    cfg = ReplayConfig(rate=args.rate, rank_rate=args.rank_rate, candidates=args.candidates, lag_s=args.lag)
    print(f"\n== 2. {live_day} live at {cfg.rate:.0f} events/s; each {cfg.lag_s:g} s after its batch, an "
          f"impression's user ranked ({cfg.candidates} candidates, every request's features logged); "
          f"{os.cpu_count()} CPUs ({cpu_model()}), load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    if (ws / "live_ranked.parquet").exists():  # a run that stopped after the live day: its figures stand
        ranked, streamed = (
            pd.read_parquet(ws / "live_ranked.parquet"),
            json.loads((ws / "streamed.json").read_text()),
        )
        print("   (the live day of an earlier run, kept in the workspace)")
    else:
        replay, streamed = live(ws, epoch, live_day, cfg, args.port, args.list_events)
        ranked = replay.ranked
        ranked.to_parquet(ws / "live_ranked.parquet")
        (ws / "streamed.json").write_text(json.dumps(streamed))
    print(f"   streamed {streamed}; ranked {len(ranked)} impressions "
          f"({(ranked['reasons'] != '').sum()} degraded)", flush=True)  # fmt: skip

    print(f"\n== 3. {live_day} ingested from the collector's export; training set through it; skew-check")
    if not (ws / "offline" / "events" / f"date={live_day}").exists():
        gemflow(ws, "ingest", "--date", str(live_day), log=ws / "stages.log")
    if not (ws / "training" / "live-day").exists():
        gemflow(ws, "build-training-set", "--name", "live-day", "--end", str(live_day), log=ws / "stages.log")
    out = gemflow(ws, "skew-check", "--training-set", "live-day", "--dates", str(live_day),
                  "--json", str(ws / "skew.json"), log=ws / "stages.log")  # fmt: skip
    print(out.stdout)
    skew = json.loads((ws / "skew.json").read_text())

    print(f"== 4. the promoted ranker on the {len(ranked)} ranked impressions of {live_day}")
    quality = served_vs_trained(ranked, ws / "models/ranker/ranker", ws / "training/live-day")
    print(format_quality(quality))
    report = {"live_day": str(live_day), "replay": vars(cfg), "list_events": args.list_events or "platform", "streamed": streamed, "skew": skew,
              "quality": quality, "seconds": round(time.monotonic() - started), "cpu": cpu_model(),
              "load_average": os.getloadavg()}  # fmt: skip
    (args.json or ws / "live_day.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {args.json or ws / 'live_day.json'} ({report['seconds']} s in all)")
    if args.record:
        record_rows(report)


def live(ws: Path, epoch: dt.date, day: dt.date, cfg, port: int, list_events: int = 0):
    """The ranker and the collector up on ``ws``; ``day`` landed live through them (``land-synthetic --live``'s
    path) while its impressions are ranked; both stopped after the collector exported every event."""
    from features.sources.synthetic import SyntheticConfig
    from gemflow.commands.landing import land_day
    from gemflow.config import load_config

    ranker_url, events_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 10}"
    logs = ws / "platform-logs"
    logs.mkdir(exist_ok=True)
    ranker = spawn(ws, logs / "serve.log", "serve", "--model-uri", "models:/gem-ranker@champion",
                   "--http-port", str(port), "--set", "feature_log.sample_rate=1.0")  # fmt: skip
    lists = ("--set", f"recent_events={list_events}") if list_events else ()
    collector = spawn(ws, logs / "events.log", "events", "serve", "--port", str(port + 10),
                      "--set", "export_every_s=2", *lists)  # fmt: skip
    replayed = {}
    try:
        wait_ready(ranker_url, ranker)
        wait_collector(events_url, collector)

        def stream(table):
            ads = pq.read_table(Workspace(ws).raw("ads", day), columns=["ad_id"])["ad_id"].to_numpy()
            replayed["replay"] = replay_day(table, ads, events_url, ranker_url, cfg)
            return replayed["replay"].streamed

        synthetic = load_config(SyntheticConfig, ROOT / "configs/embedded-synthetic.yaml")
        summary = land_day(synthetic, Workspace(ws), day, epoch, stream)
        streamed = summary["live"]
        deadline = time.monotonic() + 120
        while exported(ws, day) < streamed["accepted"] + streamed["duplicates"]:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"the collector exported {exported(ws, day)} of {streamed['accepted']} events"
                )
            time.sleep(1)
    finally:
        for proc in (collector, ranker):  # TERM: the ranker writes its buffered feature log on the way out
            proc.terminate()
            proc.wait(60)
    return replayed["replay"], streamed


def spawn(ws: Path, log: Path, *args: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*GEMFLOW, *args, "-w", str(ws)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )


def exported(ws: Path, day: dt.date) -> int:
    files = (ws / "raw" / LIVE_TABLE / f"date={day}").glob("*.parquet")
    return sum(pq.read_metadata(f).num_rows for f in files)


def format_quality(q: dict) -> str:
    lines = [f"   {q['impressions']} impressions, {q['clicks']} clicks ({q['not_in_training_set']} not in the set)",
             f"   {'':<22} {'NE':>8} {'AUC':>8} {'calibration':>12}"]  # fmt: skip
    for name, m in (("trained-on features", q["trained_features"]), ("served (p_click)", q["served"])):
        lines.append(f"   {name:<22} {m['ne']:>8.4f} {m['auc']:>8.4f} {m['calibration']:>12.4f}")
    d = q["score_abs_diff"]
    lines.append(f"   |served - trained| per impression: max {d['max']:.2e}, p99 {d['p99']:.2e}, "
                 f"{d['over_1e-4']} over 1e-4")  # fmt: skip
    return "\n".join(lines)


def record_rows(report: dict) -> None:
    skew, q = report["skew"], report["quality"]
    nonzero = {k: v["rate"] for k, v in skew["features"].items() if v["mismatches"]}
    load = f"{report['replay']['rate']:.0f} events/s, {report['replay']['lag_s']:g} s lag, online lists {report['list_events']}"
    rows = [
        ("live day streamed (events accepted / duplicates / rejected)",
         f"{report['streamed']['accepted']:,} / {report['streamed']['duplicates']} / "
         f"{report['streamed']['rejected']} in {report['streamed']['seconds']:.0f} s"),
        ("served rows checked by skew-check", f"{skew['rows']:,} (fresh_delay_s {skew['fresh_delay_s']})"),
        ("features with a mismatch (rate)", ", ".join(f"{k} {v:.2%}" for k, v in nonzero.items()) or "none: every rate 0"),
        ("of them, event windows cut short by a full online list (newer events in the delay window)",
         f"{skew['events_cut_short']:,} of {max((v['mismatches'] for v in skew['features'].values()), default=0):,}"),
        ("NE / AUC / calibration on trained-on features",
         "{ne:.4f} / {auc:.4f} / {calibration:.4f}".format(**q["trained_features"])),
        ("NE / AUC / calibration as served", "{ne:.4f} / {auc:.4f} / {calibration:.4f}".format(**q["served"])),
        ("ranked impressions / clicks; max |served - trained| p_click",
         f"{q['impressions']:,} / {q['clicks']}; {q['score_abs_diff']['max']:.1e}"),
        ("this invocation (stages already in the workspace skipped) / load average (1 min)",
         f"{report['seconds']} s / {report['load_average'][0]:.1f}"),
    ]  # fmt: skip
    key = "live-day" if report["list_events"] == "platform" else f"live-day.lists-{report['list_events']}"
    record(key, f"train = serve on a live demo day (bench/live_day.py), {load}", rows)


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    main()
