"""Served-feature logging: the user-side inputs the ranker actually scored a request with, sampled, written to the
offline store (``offline/served_features/date=D/``) for ``gemflow skew-check`` to hold against training.

A sampled request's scorer attaches ``served_row`` (the fresh-event window after the shared transform, the profile
ids, the embedding's version) to its answer under ``LOGGED``; the predictor takes it off the answer before it is
encoded and hands it to ``FeatureLog``, which buffers rows and writes one parquet file per flush off the event
loop. Candidate features are not logged: they come from the ad table, whose as-of time every answer reports.

Why not Feast's feature-service logging: it logs the raw values of a Feast online read, and serving reads the
store through its own fast path (``features.feature_repo.online_read``); what skew must be measured on is the
model's input after the transform, which only the scorer has.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gemflow.workspace import Workspace
from models.training.batch import Events
from serving.config import FeatureLogConfig
from serving.inputs import fresh_window
from serving.user_features import UserFeatures

log = logging.getLogger(__name__)
TABLE = "served_features"
LOGGED = "served_features"  # the answer key a sampled request's row travels under (never sent to the client)
EVENT_FIELDS = {  # logged list column -> Events field
    "recent_ad_ids": "ad_id",
    "recent_actions": "action",
    "recent_category_ids": "category_id",
    "recent_surfaces": "surface",
    "recent_advertiser_ids": "advertiser_id",
    "recent_ts": "ts",
    "recent_gap_buckets": "gap_bucket",
}
SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string()),
        pa.field("user_id", pa.int64()),
        pa.field("request_ts", pa.float64()),
        pa.field("model_version", pa.string()),
        pa.field("fresh_delay_s", pa.int64()),
        pa.field("recent_events", pa.int64()),
        pa.field("time_buckets", pa.int64()),
        *(pa.field(name, pa.list_(pa.int64())) for name in EVENT_FIELDS),
        pa.field("user_gender", pa.int64()),  # -1: none in the store (training's missing value)
        pa.field("user_country", pa.int64()),
        pa.field("user_age", pa.float64()),  # NaN: none
        pa.field("embedding_version", pa.string()),
    ]
)


def served_row(request_id: str, user_id: int, request_ts: float, model_version: str, ranker_cfg,
               recent: Events, feats: UserFeatures | None) -> dict:  # fmt: skip
    """One log row: what the scorer read for this request (``recent``: the window it scored with). Ad ids are
    logged raw, as the stores hold them (``recent.ad_id`` holds the model's rows: its vocabulary's business)."""
    raw_ads: list[int] = []
    if feats is not None and feats.recent is not None:
        window = fresh_window(feats.recent, request_ts, ranker_cfg.recent_events, ranker_cfg.fresh_delay_s)
        raw_ads = feats.recent["recent_ad_ids"][window].tolist()
    return {
        "request_id": request_id,
        "user_id": int(user_id),
        "request_ts": float(request_ts),
        "model_version": str(model_version),
        "fresh_delay_s": int(ranker_cfg.fresh_delay_s),
        "recent_events": int(ranker_cfg.recent_events),
        "time_buckets": int(ranker_cfg.time_buckets),
        **{name: getattr(recent, f).tolist() for name, f in EVENT_FIELDS.items()},
        "recent_ad_ids": raw_ads,
        "user_gender": -1 if feats is None or feats.gender is None else int(feats.gender),
        "user_country": -1 if feats is None or feats.country is None else int(feats.country),
        "user_age": np.nan if feats is None or feats.age is None else float(feats.age),
        "embedding_version": None if feats is None else feats.embedding_version,
    }


class FeatureLog:
    """Buffers served rows; writes them as parquet partitions of the request's UTC day, one writer thread."""

    def __init__(self, ws: Workspace, cfg: FeatureLogConfig):
        self.ws, self.cfg = ws, cfg
        self._rows: list[dict] = []
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="feature-log")
        self.written = 0

    def add(self, row: dict) -> None:
        with self._lock:
            self._rows.append(row)
            due = (
                len(self._rows) >= self.cfg.flush_rows
                or time.monotonic() - self._since >= self.cfg.flush_seconds
            )
            rows = self._take() if due else None
        if rows:
            self._writer.submit(self._write, rows)

    def close(self) -> None:
        """Write what is buffered and wait for the writer (the server's shutdown)."""
        with self._lock:
            rows = self._take()
        if rows:
            self._writer.submit(self._write, rows)
        self._writer.shutdown(wait=True)

    def _take(self) -> list[dict]:
        rows, self._rows, self._since = self._rows, [], time.monotonic()
        return rows

    def _write(self, rows: list[dict]) -> None:
        try:
            table = pa.Table.from_pylist(rows, schema=SCHEMA)
            day = np.array([dt.datetime.fromtimestamp(r["request_ts"], dt.UTC).date() for r in rows])
            for d in np.unique(day):
                folder = self.ws.offline(TABLE, d)
                folder.mkdir(parents=True, exist_ok=True)
                part = table.filter(pa.array(day == d))
                tmp = folder / f".part-{os.getpid()}-{uuid.uuid4().hex}.parquet"
                pq.write_table(part, tmp)
                tmp.rename(folder / tmp.name[1:])  # readers never see a half-written file
            self.written += len(rows)
        except Exception:  # a full disk must not take serving down: the rows are lost, and it is said
            log.exception("feature log: %d served row(s) could not be written", len(rows))
