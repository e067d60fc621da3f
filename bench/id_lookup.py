"""What mapping raw ids costs per request: the model's vocabulary lookup (``features.vocabulary``) and the ad
table's positions (``serving.ad_table.AdSnapshot.positions``) for one request's candidates, with small integer
ids (the arrays indexed by id) and with hashed text ids (sorted ids + searchsorted). Prints microseconds per
request and the CPU.

    .venv/bin/python bench/id_lookup.py [--ads 100000] [--candidates 1000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import time

import numpy as np

from features.vocabulary import Vocabulary, VocabularyConfig, raw_id, text_id
from models.training.dense import DenseSpec
from serving.ad_table import AdSnapshot
from serving.id_rows import IdRows
from serving.inputs import AdArrays, candidate_rows


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def per_call_us(fn, repeats: int = 2000, warmup: int = 50) -> float:
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e6 * (time.perf_counter() - t0) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ads", type=int, default=100_000)
    parser.add_argument("--candidates", type=int, default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_name()}; {args.ads:,} ads, {args.candidates:,} candidates per request")
    small = np.arange(args.ads, dtype=np.int64)
    hashed = np.array([raw_id(f"SKU-{i}") for i in range(args.ads)], np.int64)
    for name, ids in (("small integer ids", small), ("hashed text ids", hashed)):
        vocab = Vocabulary.build("ad_id", np.repeat(ids, 2), VocabularyConfig())
        snap = AdSnapshot.from_rows(ids, {"ctr": rng.random(len(ids))}, dt.datetime.now(dt.UTC))
        ads = AdArrays.build(snap, DenseSpec(["ctr"], [0.0], [1.0]), IdRows(ad=vocab))
        request = rng.choice(ids, args.candidates, replace=False)

        def serving_path(r=request, a=ads):  # what RequestScorer.rank does with the candidates' ids
            positions = a.positions(r)
            return candidate_rows(r, positions, a)

        layout = "arrays by id" if snap.ids is None else "sorted ids"
        print(
            f"{name:18s} ({layout:12s}) positions + model rows {per_call_us(serving_path):7.1f} us/request; "
            f"vocabulary lookup alone {per_call_us(lambda v=vocab, r=request: v.lookup(r)):7.1f} us/request"
        )
    texts = [f"SKU-{i}" for i in rng.choice(args.ads, args.candidates, replace=False)]
    first = per_call_us(lambda: [text_id(t) for t in texts], 20, warmup=0)
    again = per_call_us(lambda: [raw_id(t) for t in texts], 200)
    print(
        f"{args.candidates:,} text ids -> raw ids: {first:7.1f} us hashed (BLAKE2b), {again:7.1f} us cached (raw_id)"
    )


if __name__ == "__main__":
    main()
