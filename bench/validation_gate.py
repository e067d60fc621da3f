"""How long the validation gate takes on a large events partition (clean, and with every defect class injected).

    .venv/bin/python bench/validation_gate.py --rows 1000000 [--rate 0.002] [--no-data-docs]

Prints wall and CPU seconds (CPU time is the fairer figure on a shared machine) and rows/s per scenario; the pipeline's budget is >= 1M events per minute end to end, so the gate
should take a small fraction of a minute per million events.
"""

from __future__ import annotations

import argparse
import datetime as dt
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from report import add_record_flag, record

from features.schema import ACTIONS, DEFECTS, SURFACES
from features.sources.defects import inject_defects
from features.validation import GateConfig, ValidationGateError, validate_partition

DAY = dt.date(2024, 3, 1)


def synthetic_events(n: int, num_ads: int, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(seed)
    ads = pd.DataFrame(
        {
            "ad_id": np.arange(num_ads, dtype=np.int64),
            "advertiser_id": rng.integers(0, 1_000, num_ads),
            "category_id": rng.integers(0, 100, num_ads).astype(np.int32),
            "categories": [np.array([c], dtype=np.int32) for c in rng.integers(0, 100, num_ads)],
            "quality": rng.random(num_ads).astype(np.float32),
            "created_ts": pd.Timestamp("2024-01-01", tz="UTC"),
        }
    )
    action = rng.choice(np.asarray(ACTIONS, dtype=object), n)
    click = ((action == "impression") & (rng.random(n) < 0.05)).astype(np.int8)
    start = pd.Timestamp(DAY.isoformat(), tz="UTC")
    events = pd.DataFrame(
        {
            "event_id": np.arange(n, dtype=np.int64),
            "user_id": rng.integers(0, 100_000, n),
            "ad_id": rng.integers(0, num_ads, n),
            "action": action,
            "surface": rng.choice(np.asarray(SURFACES, dtype=object), n),
            "ts": (start + pd.to_timedelta(np.sort(rng.integers(0, 86_400_000_000, n)), unit="us")).astype(
                "datetime64[us, UTC]"
            ),
            "click": click,
            "conversion": (click.astype(bool) & (rng.random(n) < 0.1)).astype(np.int8),
        }
    )
    return events, ads


def run(
    name: str, events: pd.DataFrame, ads: pd.DataFrame, config: GateConfig, report_dir: Path
) -> tuple[str, str]:
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        result = validate_partition(
            "events", events, day=DAY, report_dir=report_dir / name, ads=ads, config=config
        )
        verdict = "passed"
    except ValidationGateError as err:
        result, verdict = err.result, "failed"
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    print(
        f"{name:<22} rows={len(events):>9,} accepted={len(result.accepted):>9,} "
        f"quarantined={len(result.quarantined):>7,} {verdict:<6} wall {seconds:6.2f} s  cpu {cpu:6.2f} s  "
        f"{len(events) / seconds:>11,.0f} rows/s"
    )
    return f"{name}: {len(events):,} rows, {verdict}", f"{len(events) / seconds:,.0f} rows/s, {cpu:.2f} s CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--ads", type=int, default=20_000)
    parser.add_argument(
        "--rate", type=float, default=0.002, help="rate per defect class in the dirty scenario"
    )
    parser.add_argument("--no-data-docs", action="store_true")
    add_record_flag(parser)
    args = parser.parse_args()

    events, ads = synthetic_events(args.rows, args.ads)
    config = GateConfig(data_docs=not args.no_data_docs)
    rates = {d: args.rate for d in DEFECTS if d != "volume_drop"}
    dirty, counts = inject_defects(events, rates, day=DAY, ads=ads, rng=np.random.default_rng(1))
    print(f"data docs: {config.data_docs}; injected per class: {counts}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            run("clean", events, ads, config, Path(tmp)),
            run("all defects", dirty, ads, config, Path(tmp)),
        ]
    if args.record:
        record("validation_gate", "GX validation gate (bench/validation_gate.py)", rows)


if __name__ == "__main__":
    main()
