"""``gemflow skew-check``: the features serving logged (``serving.feature_log``) against what the training-set
builder gives the same user at the same request time, feature by feature.

Training side, for each logged (user, request_ts): the fresh-event window through ``TrainingSet.events_at`` (the
user's accepted history from the offline store, the ranker's ``fresh_delay_s`` as logged), and the profile and
cached embedding version through the training set's own point-in-time Feast join (``join_features``). Both
sides then go through nothing but equality: a mismatch rate of 0 means the model scored exactly what it was
trained on. A non-zero rate on the fresh events comes from events that reached the online store later than
``fresh_delay_s`` (the push path's latency budget) or never (a lost event), or from a training set that does
not yet hold the logged day's events (build it after the day's ingest).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from features.feature_repo.offline import partition_days, read_days
from features.feature_repo.tables import EVENT_TS
from features.training_sets import TrainingSetConfig, join_features
from gemflow.config import load_config
from gemflow.workspace import Workspace
from models.training.data import TrainingSet, profile_column
from serving.feature_log import EVENT_FIELDS, TABLE

PROFILE_FIELDS = ("user_gender", "user_country", "user_age")


def read_served(ws: Workspace, days: list[dt.date] | None = None) -> pd.DataFrame:
    """The logged rows of ``days`` (default: every logged day), in request-time order."""
    days = days if days is not None else partition_days(ws, "offline", TABLE)
    frame = read_days(ws, TABLE, days)
    if frame.empty:
        raise FileNotFoundError(
            f"no served-feature logs under {ws.offline(TABLE)} for {[d.isoformat() for d in days] or 'any day'}: "
            "serve with feature_log.sample_rate > 0 first"
        )
    return frame.sort_values("request_ts", kind="stable").reset_index(drop=True)


def _training_events(data: TrainingSet, user_ids: np.ndarray, served: pd.DataFrame) -> pd.DataFrame:
    """The fresh-event lists training reads for each logged (user, time), under the logged ranker settings."""
    ids = pq.read_table(data.path / "sequences.parquet", columns=["user_id"])["user_id"].to_numpy()
    row = pd.Index(ids).get_indexer(user_ids)
    out = {name: [[] for _ in range(len(served))] for name in EVENT_FIELDS}
    keys = ["recent_events", "time_buckets", "fresh_delay_s"]
    for (n, buckets, delay), group in served.groupby(keys, sort=False):
        idx = group.index.to_numpy()
        known = idx[row[idx] >= 0]  # a user the training set has no history for reads no events
        if not len(known):
            continue
        user_row = row[known]
        events = data.events_at(user_row, data.seq_lengths[user_row], served["request_ts"].to_numpy()[known],
                                int(n), int(buckets), gap_to="request", fresh_delay_s=int(delay))  # fmt: skip
        bounds = events.offsets.numpy()
        for name, field in EVENT_FIELDS.items():
            values = getattr(events, field).numpy()
            for k, i in enumerate(known):
                out[name][i] = values[bounds[k] : bounds[k + 1]].tolist()
    return pd.DataFrame(out)


def _training_profile(ws: Workspace, data: TrainingSet, served: pd.DataFrame) -> pd.DataFrame:
    """Profile ids and embedding version from the training set's point-in-time join at each request time."""
    saved = data.path / "config.yaml"  # the builder's own settings (feature store, feature service)
    cfg = load_config(TrainingSetConfig, saved if saved.exists() else None)
    keys = pd.DataFrame({
        "user_id": served["user_id"].to_numpy(np.int64),
        "ad_id": np.full(len(served), -1, np.int64),  # no candidate: the user side only
        # whole microseconds (the stores' unit): a float request time carries sub-µs noise Feast refuses to cast
        EVENT_TS: pd.to_datetime(np.round(served["request_ts"].to_numpy() * 1e6).astype(np.int64), unit="us", utc=True),
    })  # fmt: skip
    joined = join_features(ws, keys, cfg)[0].to_pandas()
    out = pd.DataFrame(index=served.index)
    for name, what in zip(PROFILE_FIELDS, ("gender", "country", "age"), strict=True):
        values = profile_column(joined, what)
        missing = np.full(len(served), np.nan) if values is None else values
        out[name] = missing if what == "age" else np.nan_to_num(missing, nan=-1).astype(np.int64)
    versions = joined["model_version"] if "model_version" in joined else pd.Series([None] * len(served))
    out["embedding_version"] = versions.where(versions.notna(), None).to_numpy()
    return out


def _normal(value):
    """Comparable form: lists as tuples, a missing value (None or NaN) as None."""
    if isinstance(value, (list, np.ndarray)):
        return tuple(int(x) for x in value)
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    return value


def skew_check(ws: Workspace, training_set: Path, days: list[dt.date] | None = None) -> dict:
    """Per-feature mismatch counts and rates of the served rows of ``days`` against ``training_set``."""
    served = read_served(ws, days)
    data = TrainingSet(Path(training_set), vocabularies={})  # raw ids, as the stores and the log hold them
    user_ids = served["user_id"].to_numpy(np.int64)
    trained = pd.concat(
        [_training_events(data, user_ids, served), _training_profile(ws, data, served)], axis=1
    )
    features = {}
    for name in (*EVENT_FIELDS, *PROFILE_FIELDS, "embedding_version"):
        pairs = zip(served[name], trained[name], strict=True)
        differs = np.array([_normal(a) != _normal(b) for a, b in pairs], bool)
        features[name] = {"mismatches": int(differs.sum()), "rate": round(float(differs.mean()), 6)}
    return {
        "rows": len(served),
        "events_cut_short": cut_short(served, trained),
        "days": sorted({dt.date.fromordinal(int(d)).isoformat() for d in served["day"]}),
        "training_set": str(training_set),
        "fresh_delay_s": sorted({int(v) for v in served["fresh_delay_s"]}),
        "features": features,
    }


def cut_short(served: pd.DataFrame, trained: pd.DataFrame) -> int:
    """Rows whose served events are exactly the newest part of training's, fewer: the online list was full of
    events newer than the cutoff (the delay window) and had dropped the oldest of the window. Not a lost event:
    a list no longer than the ranker's window; a list with room for the user's events of the delay window
    (``recent_events`` of the store > ``ranker.recent_events``) serves the whole window."""
    count = 0
    for i in range(len(served)):
        n, full = len(served["recent_ts"].iat[i]), len(trained["recent_ts"].iat[i])
        if n < full and all(
            _normal(served[f].iat[i]) == _normal(trained[f].iat[i][full - n :]) for f in EVENT_FIELDS
        ):
            count += 1
    return count


def format_report(report: dict) -> str:
    lines = [f"served rows: {report['rows']} ({', '.join(report['days'])}), fresh_delay_s "
             f"{report['fresh_delay_s']}, against {report['training_set']}", "",
             f"{'feature':<24} {'mismatches':>10} {'rate':>9}"]  # fmt: skip
    for name, f in report["features"].items():
        lines.append(f"{name:<24} {f['mismatches']:>10} {f['rate']:>9.4%}")
    lines.append(
        f"event rows cut short (served = the newest part of training's window): {report['events_cut_short']}"
    )
    return "\n".join(lines)
