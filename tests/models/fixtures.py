"""A tiny training-set writer in the exact on-disk contract of ``features.training_sets`` (for model tests).

Writes ``sequences.parquet`` (one row per user, one list column per history field, sorted by time),
``examples.parquet`` (one row per impression with ``user_row`` and ``cut``), ``ranker.parquet`` (examples +
point-in-time ad stats and user profile, ``user_embedding`` null) and ``manifest.json``.

Planted structure (so a model that reads the history against the candidate wins):
- each user has 2 long-term categories (stable) and a short-term category that changes every session;
- events pick ads from the short-term category (60%), the long-term ones (25%) or anywhere (15%); half
  the impressions show a random ad instead;
- an impression is clicked with logit -2.2 + 2.0 * [candidate category in the last 10 events]
  + 1.0 * [candidate category is long-term] + 1.2 * [the user clicked this advertiser before] + surface effect;
- a click converts with probability 0.25, or 0.6 when the user converted on that advertiser before.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from features.schema import ACTION_ID, ACTIONS, HISTORY_FIELDS, SURFACES

SPLITS = ("train", "valid", "test")


def write_training_set(
    out: Path,
    *,
    num_users: int = 40,
    num_ads: int = 80,
    num_categories: int = 8,
    num_advertisers: int = 12,
    sessions: tuple[int, int] = (2, 5),
    events_per_session: tuple[int, int] = (4, 12),
    impression_rate: float = 0.5,
    seed: int = 0,
) -> Path:
    rng = np.random.default_rng(seed)
    ad_category = rng.integers(0, num_categories, num_ads)
    ad_advertiser = rng.integers(0, num_advertisers, num_ads)
    ad_quality = rng.uniform(0, 1, num_ads).astype(np.float32)
    ads_by_category = [np.flatnonzero(ad_category == c) for c in range(num_categories)]
    base_ts = 1_700_000_000
    surface_effect = np.linspace(-0.3, 0.3, len(SURFACES))

    seq_rows, examples = [], []
    event_id = 0
    for user in range(num_users):
        long_term = rng.choice(num_categories, 2, replace=False)
        t = base_ts + int(rng.integers(0, 3600))
        events: dict[str, list[int]] = {f: [] for f in HISTORY_FIELDS}
        clicked_adv: set[int] = set()
        converted_adv: set[int] = set()
        for _ in range(int(rng.integers(*sessions))):
            short_term = int(rng.integers(0, num_categories))
            t += int(rng.integers(6 * 3600, 3 * 86400))
            for _ in range(int(rng.integers(*events_per_session))):
                t += int(rng.integers(10, 600))
                u = rng.uniform()
                cat = short_term if u < 0.6 else int(rng.choice(long_term)) if u < 0.85 else None
                pool = (
                    ads_by_category[cat]
                    if cat is not None and len(ads_by_category[cat])
                    else np.arange(num_ads)
                )
                ad = int(rng.choice(pool))
                surface = int(rng.integers(0, len(SURFACES)))
                if rng.uniform() < impression_rate:
                    if rng.uniform() < 0.5:  # half the impressions are untargeted: matches are informative
                        ad = int(rng.integers(0, num_ads))
                    recent = set(events["category_id"][-10:])
                    logit = (
                        -2.2
                        + 2.0 * (ad_category[ad] in recent)
                        + 1.0 * (ad_category[ad] in long_term)
                        + 1.2 * (int(ad_advertiser[ad]) in clicked_adv)
                        + surface_effect[surface]
                    )
                    click = int(rng.uniform() < 1 / (1 + np.exp(-logit)))
                    p_conv = 0.6 if int(ad_advertiser[ad]) in converted_adv else 0.25
                    conversion = int(click and rng.uniform() < p_conv)
                    examples.append(
                        dict(
                            example_id=event_id,
                            user_id=user,
                            user_row=user,
                            cut=len(events["ts"]),
                            ad_id=ad,
                            advertiser_id=int(ad_advertiser[ad]),
                            category_id=int(ad_category[ad]),
                            quality=float(ad_quality[ad]),
                            surface=surface,
                            ts=t,
                            click=click,
                            conversion=conversion,
                        )
                    )
                    _append(events, ad, ACTION_ID["impression"], surface, ad_category, ad_advertiser, t)
                    if click:
                        clicked_adv.add(int(ad_advertiser[ad]))
                        _append(events, ad, ACTION_ID["click"], surface, ad_category, ad_advertiser, t + 1)
                    if conversion:
                        converted_adv.add(int(ad_advertiser[ad]))
                        _append(
                            events, ad, ACTION_ID["conversion"], surface, ad_category, ad_advertiser, t + 2
                        )
                    t += 3
                else:
                    organic = int(rng.integers(ACTION_ID["view"], len(ACTIONS)))
                    _append(events, ad, organic, surface, ad_category, ad_advertiser, t)
                event_id += 1
        seq_rows.append({"user_id": user, **events})

    out.mkdir(parents=True, exist_ok=True)
    list_types = {f: pa.list_(pa.int64()) for f in HISTORY_FIELDS}
    seq_schema = pa.schema(
        [pa.field("user_id", pa.int64())] + [pa.field(f, t) for f, t in list_types.items()]
    )
    pq.write_table(pa.Table.from_pylist(seq_rows, schema=seq_schema), out / "sequences.parquet")

    ex = pd.DataFrame(examples)
    cuts = np.quantile(ex["ts"], [0.7, 0.85])
    ex["split"] = np.where(ex["ts"] < cuts[0], "train", np.where(ex["ts"] < cuts[1], "valid", "test"))
    ex["example_id"] = np.arange(len(ex), dtype=np.int64)
    ex = ex.sort_values(["ts", "example_id"], kind="stable").reset_index(drop=True)
    ex.to_parquet(out / "examples.parquet", index=False)

    ranker = ex.copy()
    ranker["ad_quality"] = ranker["quality"].astype(np.float32)
    for name, value in _ad_stats(ex).items():
        ranker[name] = value
    ranker["user_age"] = (18 + (ranker["user_id"] * 7) % 50).astype(np.int16)
    ranker["user_gender"] = (ranker["user_id"] % 3).astype(np.int32)
    ranker["user_country"] = (ranker["user_id"] % 5).astype(np.int32)
    ranker["user_embedding"] = pd.Series([None] * len(ranker), dtype=object)
    ranker["model_version"] = pd.Series([None] * len(ranker), dtype=object)
    schema = pa.Schema.from_pandas(ranker, preserve_index=False)
    schema = schema.set(
        schema.get_field_index("user_embedding"), pa.field("user_embedding", pa.list_(pa.float32()))
    )
    schema = schema.set(schema.get_field_index("model_version"), pa.field("model_version", pa.string()))
    pq.write_table(pa.Table.from_pandas(ranker, schema=schema, preserve_index=False), out / "ranker.parquet")

    manifest = {
        "vocab_sizes": {
            "ad_id": num_ads,
            "advertiser_id": num_advertisers,
            "category_id": num_categories,
            "action": len(ACTIONS),
            "surface": len(SURFACES),
            "user_id": num_users,
            "country": 5,
            "gender": 3,
        },
        "counts": {"users": num_users, "examples": len(ex), **ex["split"].value_counts().to_dict()},
        "date_range": [int(ex["ts"].min()), int(ex["ts"].max())],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def _append(events, ad, action, surface, ad_category, ad_advertiser, ts) -> None:
    events["ad_id"].append(ad)
    events["action"].append(action)
    events["surface"].append(surface)
    events["category_id"].append(int(ad_category[ad]))
    events["advertiser_id"].append(int(ad_advertiser[ad]))
    events["ts"].append(ts)


def _ad_stats(ex: pd.DataFrame) -> dict[str, np.ndarray]:
    """Impressions, clicks and CTR of the ad strictly before each example (a point-in-time join)."""
    grouped = ex.groupby("ad_id", sort=False)
    impressions = grouped.cumcount().to_numpy()
    clicks = (grouped["click"].cumsum() - ex["click"]).to_numpy()
    conversions = (grouped["conversion"].cumsum() - ex["conversion"]).to_numpy()
    return {
        "ad_impressions_28d": impressions.astype(np.int64),
        "ad_clicks_28d": clicks.astype(np.int64),
        "ad_ctr_28d": (clicks / np.maximum(impressions, 1)).astype(np.float32),
        "ad_cvr_28d": (conversions / np.maximum(clicks, 1)).astype(np.float32),
    }


def tiny_user_config(**kw):
    """A user model small enough for unit tests (reference attention: exact and dependency-free)."""
    from models.config import UserModelConfig

    base = dict(d_model=16, num_layers=1, num_heads=2, max_history=32, num_user_tokens=2, max_rel_pos=8)
    return UserModelConfig(**{**base, "attention_backend": "reference", **kw})


def tiny_ranker_config(**kw):
    from models.config import RankerConfig

    base = dict(d_model=16, num_layers=2, num_heads=2, recent_events=16, num_user_tokens=2)
    return RankerConfig(**{**base, "attention_backend": "reference", **kw})


# The shared tiny training set: written once per test process into a temp folder removed at exit.
_TMP = tempfile.TemporaryDirectory(prefix="gemflow-models-")


@functools.cache
def tiny_set_path() -> Path:
    return write_training_set(Path(_TMP.name) / "tiny", num_users=24, num_ads=40, seed=3)


@functools.cache
def tiny_set():
    from models.training.data import TrainingSet

    return TrainingSet(tiny_set_path())


@functools.cache
def tiny_dense():
    from models.training.dense import DenseSpec

    data = tiny_set()
    return DenseSpec.fit(data.dense_frame(), data.dense_columns())


def record_training_run(run_dir: Path, ws, tracking_uri: str = "") -> str:
    """A finished MLflow run recorded in ``run_dir`` as training records it, for a bundle saved without training
    (registration logs the model into that run)."""
    from models.config import TrackingConfig
    from models.tracking.training_run import Tracker

    tracker = Tracker(TrackingConfig(tracking_uri=tracking_uri, experiment="fixtures"), ws, run_dir.name)
    tracker.record(run_dir)
    tracker.end()
    return tracker.run_id
