"""A tiny, real serving world: Feast offline tables + an applied, materialized SQLite online store, a small
ranker bundle, and the same users/candidates written as a training set for the offline batch path.

Users 0..3 have a profile, recent events and an embedding (user 2's embedding comes from an older user-model
version); user 4 has no embedding; user 5 is unknown to the store. History events are all on the ``feed``
surface: the ``user_recent_events`` view carries no per-event surface, so serving fills ``feed`` for it
(``serving.inputs.MISSING_SURFACE``); with any other surface the two paths would differ by design.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from features.feature_repo import FeatureStoreConfig
from features.feature_repo.offline import write_partition
from features.feature_repo.tables import (
    CREATED_TS,
    EVENT_TS,
    FEATURE_TABLES,
    STATS_KINDS,
    STATS_WINDOWS,
    stats_column,
)
from features.schema import ACTIONS, GENDERS, SURFACES
from gemflow.workspace import Workspace
from tests.ports import free_port  # noqa: F401 (the serving tests import it from here)

DAY = dt.date(2026, 3, 2)
DAY_END = dt.datetime.combine(DAY + dt.timedelta(days=1), dt.time(), tzinfo=dt.UTC)
REQUEST_TS = int(DAY_END.timestamp()) + 3600  # one hour after the features were computed
NUM_USERS, NUM_ADS, NUM_CATEGORIES, NUM_ADVERTISERS = 6, 60, 5, 7
KNOWN_USERS = (0, 1, 2, 3, 4)
HEALTHY_USERS = (0, 1, 3)  # an embedding of the current user-model version: the normal (non-degraded) path
USER_MODEL_VERSION, OLD_USER_MODEL_VERSION = "user-model/3", "user-model/2"
NUM_USER_TOKENS, USER_TOKEN_DIM = 2, 8
DENSE_COLUMNS = ["quality", "ad_quality", "impressions_7d", "clicks_7d", "ctr_7d", "cvr_28d"]


@dataclass
class World:
    ws: Workspace
    model_path: Path
    ads: pd.DataFrame  # ad_id, advertiser, category, quality + stats
    users: pd.DataFrame  # user_id, age, gender, country
    recent: dict[int, pd.DataFrame]  # user -> its recent events (oldest first)
    embeddings: dict[int, tuple[np.ndarray, str]]


def _stamp(df: pd.DataFrame) -> pd.DataFrame:
    df[EVENT_TS] = pd.Timestamp(DAY_END)
    df[CREATED_TS] = pd.Timestamp(DAY_END)
    return df


def _write(ws: Workspace, table: str, df: pd.DataFrame) -> None:
    schema = FEATURE_TABLES[table]
    write_partition(
        ws.offline(table, DAY), pa.Table.from_pandas(df[schema.names], schema=schema, preserve_index=False)
    )


def build_world(
    root: Path,
    seed: int = 0,
    num_ads: int = NUM_ADS,
    d_model: int = 16,
    max_recent: int = 20,
    store_cfg: FeatureStoreConfig | None = None,
) -> World:
    """``num_ads`` / ``d_model`` grow it for the load bench (``bench/serve.py --build-world``); ``store_cfg``
    picks the online store (default: the embedded SQLite one; a Redis one for the outage test)."""
    rng = np.random.default_rng(seed)
    ws = Workspace(root / "ws")
    ads = pd.DataFrame(
        {
            "ad_id": np.arange(num_ads, dtype=np.int64),
            "ad_advertiser_id": rng.integers(0, NUM_ADVERTISERS, num_ads),
            "ad_category_id": rng.integers(0, NUM_CATEGORIES, num_ads),
            "ad_quality": rng.uniform(0, 1, num_ads).astype(np.float32),
        }
    )
    for days in STATS_WINDOWS:
        imp = rng.integers(0, 500 * days, num_ads)
        clicks = rng.binomial(imp, 0.05)
        conv = rng.binomial(clicks, 0.2)
        ads[stats_column("impressions", days)] = imp
        ads[stats_column("clicks", days)] = clicks
        ads[stats_column("conversions", days)] = conv
        ads[stats_column("ctr", days)] = (clicks / np.maximum(imp, 1)).astype(np.float32)
        ads[stats_column("cvr", days)] = (conv / np.maximum(clicks, 1)).astype(np.float32)
    assert all(stats_column(k, d) in ads for k in STATS_KINDS for d in STATS_WINDOWS)
    _write(ws, "ad_attributes", _stamp(ads.copy()))
    _write(ws, "ad_stats", _stamp(ads.copy()))

    users = pd.DataFrame(
        {
            "user_id": np.array(KNOWN_USERS, np.int64),
            "user_age": rng.integers(18, 70, len(KNOWN_USERS)),
            "user_gender": rng.integers(0, len(GENDERS), len(KNOWN_USERS)),
            "user_country": rng.integers(0, 4, len(KNOWN_USERS)),
        }
    )
    _write(ws, "user_profile", _stamp(users.copy()))

    recent, rows = {}, []
    for user in KNOWN_USERS:
        n = int(rng.integers(3, max_recent + 1))
        ts = np.sort(REQUEST_TS - 3600 - rng.integers(60, 20 * 86400, n)).astype(np.int64)
        ad = rng.integers(0, num_ads, n)
        ev = pd.DataFrame(
            {
                "ad_id": ad,
                "action": rng.integers(0, len(ACTIONS), n),
                "category_id": ads["ad_category_id"].to_numpy()[ad],
                "advertiser_id": ads["ad_advertiser_id"].to_numpy()[ad],
                "surface": np.zeros(n, np.int64),  # see the module docstring
                "ts": ts,
            }
        )
        recent[user] = ev
        rows.append(
            {
                "user_id": user,
                "recent_ad_ids": ev["ad_id"].tolist(),
                "recent_actions": ev["action"].tolist(),
                "recent_category_ids": ev["category_id"].tolist(),
                "recent_ts": ev["ts"].tolist(),
                "recent_time_gaps": (DAY_END.timestamp() - ev["ts"]).astype(np.float32).tolist(),
                "recent_surfaces": ev["surface"].tolist(),
                "recent_advertiser_ids": ev["advertiser_id"].tolist(),
                "recent_event_ids": (user * 1_000 + np.arange(n)).tolist(),
                "recent_ts_us": (ev["ts"] * 1_000_000).tolist(),
            }
        )
    _write(ws, "user_recent_events", _stamp(pd.DataFrame(rows)))

    embeddings = {}
    for user in (0, 1, 2, 3):
        version = OLD_USER_MODEL_VERSION if user == 2 else USER_MODEL_VERSION
        embeddings[user] = (rng.normal(0, 1, NUM_USER_TOKENS * USER_TOKEN_DIM).astype(np.float32), version)
    emb = pd.DataFrame(
        {
            "user_id": list(embeddings),
            "user_embedding": [e.tolist() for e, _ in embeddings.values()],
            "model_version": [v for _, v in embeddings.values()],
        }
    )
    _write(ws, "user_embedding", _stamp(emb))

    from features.store import open_store

    store = open_store(ws, store_cfg, apply=True)
    store.materialize(DAY_END - dt.timedelta(days=2), DAY_END + dt.timedelta(minutes=1))
    model_path = _tiny_ranker(root / "ranker", ads, seed, d_model)
    return World(
        ws,
        model_path,
        ads,
        users.rename(columns=lambda c: c.removeprefix("user_") if c != "user_id" else c),
        recent,
        embeddings,
    )


def _tiny_ranker(out: Path, ads: pd.DataFrame, seed: int, d_model: int) -> Path:
    import torch

    from models.config import RankerConfig
    from models.inference.bundle import MODEL_FILE, ModelBundle, build_model, save_bundle
    from models.training.dense import DenseSpec

    torch.manual_seed(seed)
    # tiny for the tests; at the bench's d_model 64 the default ranker (configs/ranker.yaml: 4 heads, FFN x2)
    heads = 2 if d_model <= 16 else RankerConfig.num_heads
    cfg = RankerConfig(
        d_model=d_model,
        num_layers=2,
        num_heads=heads,
        ffn_mult=2,
        num_user_tokens=NUM_USER_TOKENS,
    )
    vocab = world_vocabulary(len(ads))
    frame = ads.assign(quality=ads["ad_quality"])
    dense = DenseSpec.fit(frame, DENSE_COLUMNS)
    model = build_model("ranker", cfg, vocab, len(dense.columns), USER_TOKEN_DIM)
    with torch.no_grad():  # spread the weights so scores differ visibly between users and candidates
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    bundle = ModelBundle("ranker", model, vocab, dense, USER_TOKEN_DIM, "ranker-run-1", USER_MODEL_VERSION)
    save_bundle(out / MODEL_FILE, bundle)
    return out / MODEL_FILE


def write_offline_set(world: World, out: Path, user: int, candidates: np.ndarray, surface: int) -> Path:
    """The (user, candidate) pairs as a training set in ``features.training_sets``' contract, features joined as
    Feast would join them (``ranker.parquet``), for ``models.inference.bundle.predict``."""
    out.mkdir(parents=True, exist_ok=True)
    hist = world.recent.get(user)
    seq = {
        f: ([] if hist is None else hist[f].tolist())
        for f in ("ad_id", "action", "surface", "category_id", "advertiser_id", "ts")
    }
    seq_schema = pa.schema(
        [pa.field("user_id", pa.int64())] + [pa.field(f, pa.list_(pa.int64())) for f in seq]
    )
    pq.write_table(
        pa.Table.from_pylist([{"user_id": user, **seq}], schema=seq_schema), out / "sequences.parquet"
    )
    ads = world.ads.set_index("ad_id").loc[candidates]
    n = len(candidates)
    ex = pd.DataFrame(
        {
            "example_id": np.arange(n, dtype=np.int64),
            "user_id": np.full(n, user, np.int64),
            "user_row": np.zeros(n, np.int64),
            "cut": np.full(n, len(seq["ts"]), np.int64),
            "ad_id": candidates.astype(np.int64),
            "advertiser_id": ads["ad_advertiser_id"].to_numpy(np.int64),
            "category_id": ads["ad_category_id"].to_numpy(np.int64),
            "quality": ads["ad_quality"].to_numpy(np.float32),
            "surface": np.full(n, surface, np.int64),
            "ts": np.full(n, REQUEST_TS, np.int64),
            "click": np.zeros(n, np.int8),
            "conversion": np.zeros(n, np.int8),
            "split": ["test"] * n,
        }
    )
    ex.to_parquet(out / "examples.parquet", index=False)
    ranker = ex.copy()
    for col in world.ads.columns:
        if col not in ("ad_id", "ad_advertiser_id", "ad_category_id"):
            ranker[col] = ads[col].to_numpy()
    prof = world.users.set_index("user_id")
    for col in ("age", "gender", "country"):
        ranker[f"user_{col}"] = prof.loc[user, col] if user in prof.index else np.nan
    emb = world.embeddings.get(user)
    ranker["user_embedding"] = pd.Series([emb[0].tolist() if emb else None] * n, dtype=object)
    ranker["model_version"] = pd.Series([emb[1] if emb else None] * n, dtype=object)
    ranker.to_parquet(out / "ranker.parquet", index=False)
    (out / "manifest.json").write_text(json.dumps({"vocab_sizes": {}}))
    return out


def world_vocabulary(num_ads: int) -> dict[str, int]:
    """The world's id vocabularies (sizes), as its ranker and a user model over it read them."""
    return {"ad_id": num_ads, "advertiser_id": NUM_ADVERTISERS, "category_id": NUM_CATEGORIES,
            "action": len(ACTIONS), "surface": len(SURFACES), "gender": len(GENDERS), "country": 4,
            "user_id": NUM_USERS}  # fmt: skip


def write_retrieval_folder(
    world: World,
    out: Path,
    model_path: Path,
    cfg,
    seed: int,
    item_vectors: np.ndarray | None = None,
    extra_users: int = 0,
) -> tuple:
    """What an embedding refresh writes for the world (``out``): a next-item user model (``cfg``, a
    ``UserModelConfig``; saved to ``model_path``), its record, its ad vectors and the queries of the world's users over their
    recent events (the online lists hold each whole history) through the refresh's own computation.
    ``item_vectors`` (n_ads, d) become the model's ad rows (so the index searches vectors with the clusters of a
    trained catalog, computed by the model itself); ``extra_users`` more users after the known ones get a cached
    query (any of this version). Returns (AdVectors, {user: query})."""
    import torch

    from models.embeddings.ad_vectors import (
        USER_QUERY_FILE,
        UserModelRecord,
        UserQueries,
        ad_vectors,
        write_ad_vectors,
        write_user_model_record,
    )
    from models.embeddings.refresh import load_champion
    from models.embeddings.sequences import UserSequences, query_vectors
    from models.inference.bundle import ModelBundle, build_model, save_bundle
    from models.training.dense import DenseSpec

    torch.manual_seed(seed)
    vocab = world_vocabulary(len(world.ads))
    model = build_model("user", cfg, vocab, 1)
    if item_vectors is not None:
        with torch.no_grad():
            model.sparse.table("ad_id")[: len(item_vectors)] = torch.from_numpy(item_vectors)
    bundle = ModelBundle(
        "user", model, vocab, DenseSpec(["quality"], [0.0], [1.0]), 0, model_path.parent.name, ""
    )
    save_bundle(model_path, bundle)
    champion = load_champion(str(model_path))
    users = sorted(world.recent)
    frames = [world.recent[u] for u in users]
    offsets = np.concatenate([[0], np.cumsum([len(f) for f in frames])]).astype(np.int64)
    values = {f: np.concatenate([fr[f].to_numpy(np.int64) for fr in frames]) for f in frames[0].columns}
    queries = query_vectors(champion.bundle, UserSequences(np.array(users, np.int64), offsets, values))
    extra = list(range(max(users) + 1, max(users) + 1 + extra_users))
    queries = np.vstack([queries, queries[: len(extra)]])
    write_user_model_record(out, UserModelRecord(champion.version, champion.uri))
    write_ad_vectors(
        out,
        UserQueries(np.array([*users, *extra], np.int64), queries, champion.version),
        name=USER_QUERY_FILE,
    )
    ads = ad_vectors(champion.bundle, champion.version)
    write_ad_vectors(out, ads)
    return ads, dict(zip([*users, *extra], queries, strict=True))


MODEL = "gem-ranker"


@contextlib.contextmanager
def running_server(
    world: World, port: int, log: Path, *settings: str, ready_timeout: float = 180.0, env: dict | None = None
):
    """A real ``gemflow serve`` process on ``port`` (``settings``: ``key=value`` config overrides; ``env``: extra
    environment, e.g. tokens), stopped after."""
    from serving.client import get

    cmd = [sys.executable, "-m", "gemflow.cli", "serve", "--workspace", str(world.ws.root),
           "--model-uri", str(world.model_path), "--host", "127.0.0.1", "--http-port", str(port)]  # fmt: skip
    for setting in settings:
        cmd += ["--set", setting]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gemflow serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if get(f"{base}/v2/models/{MODEL}/ready", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in {ready_timeout:.0f} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
