"""A landed day replayed through the live event path while the ranker serves its impressions, each at its own time.

The day's events stream to the collector in time order (``features.sources.live.stream_events``, what
``gemflow land-synthetic --live`` runs); beside the stream, every ``k``-th impression's user is ranked with
``context.request_ts`` = the impression's time, its ad among the candidates, as soon as the stream has answered the
impression's batch and ``lag_s`` wall seconds have passed since that batch was sent: the ad server asks for a
ranking ``lag_s`` after the events before it were reported. With ``lag_s`` = the ranker's ``fresh_delay_s``, an
event the ranker's window holds (older than ``floor(request_ts) - fresh_delay_s``) was reported at least that long
before the read, in wall time as in the day's own time; what serving then reads must equal what training reads.

The answer of each ranked impression is kept (its ad's ``p_click``, the degraded reasons): ``served_vs_trained``
holds those scores against the model's scores on the training set's features for the same impressions.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
import pandas as pd
import pyarrow as pa

from features.sources.live import stream_events

MODEL = "gem-ranker"


@dataclass
class ReplayConfig:
    rate: float = 400.0  # events/s into the collector
    rank_rate: float = 20.0  # ranking requests/s aimed at (every k-th impression, k from the day's mix)
    candidates: int = 100  # per request: the impression's ad and others from the ads snapshot
    lag_s: float = 1.0  # wall seconds between an impression's batch being sent and its ranking request
    seed: int = 0


@dataclass
class Replay:
    streamed: dict  # stream_events' counts
    ranked: pd.DataFrame  # one row per ranked impression (event_id, user_id, ad_id, click, p_click, ...)


def ranked_impressions(events: pa.Table, rank_rate: float, rate: float) -> np.ndarray:
    """Positions (in the stream's order) of the impressions the replay ranks: every k-th one."""
    action = events.column("action").to_numpy(zero_copy_only=False)
    impressions = np.flatnonzero(action == "impression")
    seconds = events.num_rows / rate
    every = max(1, int(np.ceil(len(impressions) / max(rank_rate * seconds, 1))))
    return impressions[::every]


def replay_day(
    events: pa.Table,
    ad_ids: np.ndarray,
    events_url: str,
    ranker_url: str,
    cfg: ReplayConfig,
    events_token: str | None = None,
) -> Replay:
    """Stream ``events`` to ``events_url`` while ranking its sampled impressions at ``ranker_url``."""
    events = events.sort_by([("ts", "ascending"), ("event_id", "ascending")])  # the streamer's order
    picked = ranked_impressions(events, cfg.rank_rate, cfg.rate)
    cols = {name: events.column(name).to_numpy(zero_copy_only=False) for name in
            ("event_id", "user_id", "ad_id", "surface", "click", "conversion")}  # fmt: skip
    ts_us = events.column("ts").cast(pa.int64()).to_numpy()
    answered: list[tuple[int, float, float]] = []  # (hi, sent, answered) per batch, in order
    streamed: dict = {}
    failed: list[BaseException] = []

    def stream() -> None:
        try:
            streamed.update(stream_events(events, events_url, cfg.rate, events_token,
                                          on_batch=lambda *b: answered.append(b)))  # fmt: skip
        except BaseException as err:  # noqa: BLE001  re-raised by the caller's thread
            failed.append(err)

    streamer = threading.Thread(target=stream, name="live-day-stream", daemon=True)
    streamer.start()
    rng = np.random.default_rng(cfg.seed)
    rows = []
    with httpx.Client(base_url=ranker_url, timeout=30) as client:
        for pos in picked:
            while not _eligible(answered, pos, cfg.lag_s):
                if failed or not streamer.is_alive() and not _eligible(answered, pos, 0):
                    streamer.join()
                    raise RuntimeError(f"the event stream stopped before event {pos}: {failed}")
                time.sleep(0.005)
            ad = int(cols["ad_id"][pos])
            others = rng.choice(
                ad_ids[ad_ids != ad], size=min(cfg.candidates - 1, len(ad_ids) - 1), replace=False
            )
            request_ts = ts_us[pos] / 1e6
            context = {"surface": str(cols["surface"][pos]), "hour": int(ts_us[pos] // 3_600_000_000 % 24),
                       "request_ts": request_ts}  # fmt: skip
            body = {
                "user_id": int(cols["user_id"][pos]),
                "candidates": [ad, *others.tolist()],
                "context": context,
            }
            asked = time.monotonic()
            r = client.post(f"/v1/models/{MODEL}:predict", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"the ranker answered {r.status_code}: {r.text[:500]}")
            answer = r.json()
            at = answer["ad_ids"].index(ad)
            rows.append({
                "event_id": int(cols["event_id"][pos]), "user_id": body["user_id"], "ad_id": ad,
                "ts_us": int(ts_us[pos]), "request_ts": request_ts, "surface": context["surface"],
                "click": int(cols["click"][pos]), "conversion": int(cols["conversion"][pos]),
                "p_click": float(answer["p_click"][at]), "request_id": answer["request_id"],
                "reasons": ",".join(answer["fallback"]["reasons"]), "asked": asked,
            })  # fmt: skip
    streamer.join()
    if failed:
        raise RuntimeError(f"the event stream failed: {failed[0]}") from failed[0]
    return Replay(streamed, pd.DataFrame(rows))


def _eligible(answered: list[tuple[int, float, float]], pos: int, lag_s: float) -> bool:
    """Event ``pos``'s batch (and so every event before it) is answered, and was sent ``lag_s`` ago or more."""
    k = bisect.bisect_right(answered, pos, key=lambda batch: batch[0])  # the batch that holds ``pos``
    return k < len(answered) and answered[k][1] <= time.monotonic() - lag_s


def served_vs_trained(ranked: pd.DataFrame, run_dir, training_set) -> dict:
    """NE / AUC / calibration of the click head on the ranked impressions: (a) the model (``run_dir``) scoring
    the training set's features of each impression (``training_set`` built through the replayed day), (b) the
    ``p_click`` serving answered. Also how far the two scores of one impression lie apart."""
    from models.inference.bundle import predict
    from models.training.evaluate import load_for_evaluation
    from models.training.metrics import binary_metrics

    bundle, data, builder = load_for_evaluation(run_dir, training_set)
    row_of = pd.Series(np.arange(len(data.examples)), index=data.examples["example_id"].to_numpy())
    found = ranked["event_id"].isin(row_of.index).to_numpy()
    ranked = ranked[found]
    rows = row_of.loc[ranked["event_id"].to_numpy()].to_numpy()
    order = builder.grouped(rows)  # the builder encodes each user-day history once: its order, mapped back
    trained = np.empty(len(rows))
    trained[pd.Index(order).get_indexer(rows)] = predict(bundle.model, builder, order, 1024)[:, 0]
    labels = ranked["click"].to_numpy(np.float64)
    served = ranked["p_click"].to_numpy(np.float64)
    diff = np.abs(trained - served)
    return {
        "impressions": int(len(rows)),
        "not_in_training_set": int((~found).sum()),
        "clicks": int(labels.sum()),
        "trained_features": binary_metrics(labels, trained),
        "served": binary_metrics(labels, served),
        "score_abs_diff": {
            "max": float(diff.max()),
            "p99": float(np.percentile(diff, 99)),
            "over_1e-4": int((diff > 1e-4).sum()),
        },
    }
