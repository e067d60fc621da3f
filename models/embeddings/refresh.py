"""Batch refresh of the cached user embeddings: the champion user model over every active user's history.

For day D: read every accepted event up to the end of D, keep each active user's most recent ``max_history``
events (the same slice and time gaps the user model trains on: ``gap_to="previous"``), encode them in token-budget
batches (optionally across N processes, each a shard of users), then write

- offline: ``ws.offline("user_embedding", D)/embeddings.parquet`` stamped ``event_timestamp`` =
  ``created_timestamp`` = end of D (overwritten on re-runs; Feast's OFFLINE push would append duplicates), so a
  training example at time t joins the newest refresh that ended before t;
- online: ``store.push("user_embedding_push", ..., to=PushMode.ONLINE)``, unless a refresh of a later day is
  already there (a backfill must not overwrite newer embeddings online).

Every row carries ``model_version``: the registry version that wrote it (``gem-user-model/3``), which the
ranker's ``user_model_version`` is compared against (``models.embeddings.versions``).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from tqdm import tqdm

from features.feature_repo import FeatureStoreConfig
from features.feature_repo.offline import day_end, partition_days, write_partition
from features.feature_repo.tables import CREATED_TS, EVENT_TS, USER_EMBEDDING
from features.histories import build_histories
from features.schema import HISTORY_FIELDS
from features.stats import read_events
from gemflow.config import save_config, to_dict
from gemflow.malloc import huge_pages
from gemflow.workspace import Workspace
from models.embeddings.ad_vectors import (
    RETRIEVAL_TABLE,
    USER_QUERY_FILE,
    UserModelRecord,
    UserQueries,
    ad_vectors,
    write_ad_vectors,
    write_user_model_record,
)
from models.embeddings.batching import shard_by_tokens, token_budget_batches
from models.embeddings.sequences import UserSequences, model_inputs, query_vectors
from models.inference.bundle import ModelBundle, load_bundle, save_bundle

log = logging.getLogger(__name__)

EMBEDDING_TABLE = "user_embedding"
EMBEDDING_FILE = "embeddings.parquet"
PUSH_SOURCE = "user_embedding_push"
CHAMPION_URI = "models:/gem-user-model@champion"


@dataclass
class RefreshConfig:
    date: str = ""  # YYYY-MM-DD; "" = the latest day with accepted events
    model_uri: str = CHAMPION_URI  # registry URI, or a local model.pt / run folder (benches, tests)
    tracking_uri: str = ""  # "" = the workspace's sqlite backend (or $MLFLOW_TRACKING_URI when set)
    nproc: int = 1  # worker processes, each encoding a shard of users
    threads: int = 0  # torch threads per process; 0 = the machine's cores / nproc
    token_budget: int = 32768  # history events per batch (sum of lengths)
    max_users_per_batch: int = 512
    active_days: int = 28  # users with an event in the last N days up to D; 0 = every user with history
    history_days: int = 0  # days of events read into histories; 0 = every partition up to D
    bf16: bool = False  # bf16 autocast (faster on CPUs with AMX/AVX512-BF16; embeddings stored as float32)
    push_online: bool = True
    push_chunk: int = 5000  # rows per online push
    feature_store: FeatureStoreConfig = field(default_factory=FeatureStoreConfig)

    def validate(self) -> None:
        if self.nproc < 1 or self.threads < 0:
            raise ValueError(f"nproc must be >= 1 and threads >= 0, got {self.nproc}, {self.threads}")
        if self.token_budget < 1 or self.max_users_per_batch < 1 or self.push_chunk < 1:
            raise ValueError("token_budget, max_users_per_batch and push_chunk must be >= 1")
        if self.active_days < 0 or self.history_days < 0:
            raise ValueError("active_days and history_days must be >= 0")


# ----------------------------------------------------------------------------------------------- the champion
@dataclass
class Champion:
    bundle: ModelBundle
    version: str  # what embedding rows carry: "gem-user-model/3" (registry) or "local/<run>" (a file)
    uri: str


MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


def load_champion(model_uri: str, tracking_uri: str = "", ws: Workspace | None = None) -> Champion:
    """The user model behind ``model_uri``, pinned to one registry version (an alias is resolved once, so a gate
    moving ``@champion`` mid-refresh cannot mix two versions)."""
    path = Path(model_uri)
    if not model_uri.startswith("models:/"):
        if not path.exists():
            raise FileNotFoundError(f"{model_uri!r} is neither a models:/ URI nor an existing model.pt")
        bundle = load_local(path)
        version = f"local/{bundle.version or path.resolve().parent.name}"
        return _checked(Champion(bundle, version, str(path.resolve())))  # absolute: the server loads it too
    match = MODEL_URI.match(model_uri)
    if not match:
        raise ValueError(f"model URI {model_uri!r} must look like models:/NAME@ALIAS or models:/NAME/VERSION")
    from mlflow.exceptions import MlflowException

    from models.tracking.mlflow_store import connect
    from models.tracking.registry import load_registered

    client = connect(ws, tracking_uri)

    name, version = match["name"], match["version"]
    try:
        if match["alias"]:
            version = client.get_model_version_by_alias(name, match["alias"]).version
        pinned = f"models:/{name}/{version}"
        bundle = load_registered(pinned)
    except MlflowException as err:
        raise LookupError(f"cannot load {model_uri} from {client.tracking_uri}: {err.message}") from err
    return _checked(Champion(bundle, f"{name}/{version}", pinned))


def load_local(path: Path) -> ModelBundle:
    """``load_bundle`` with a named error when the file was written by an incompatible model version."""
    try:
        return load_bundle(path)
    except RuntimeError as err:  # load_state_dict: parameters renamed or reshaped since the file was written
        raise ValueError(
            f"{path} does not fit this code's model definition: {' '.join(str(err).split())[:300]}"
        ) from err


def _checked(champion: Champion) -> Champion:
    if champion.bundle.kind != "user":
        raise ValueError(f"{champion.uri} is a {champion.bundle.kind}, not a user model")
    return champion


# ----------------------------------------------------------------------------------------------- histories
def refresh_day(ws: Workspace, date: str) -> dt.date:
    days = partition_days(ws, "offline", "events")
    if not days:
        raise FileNotFoundError(
            f"no accepted events under {ws.offline('events')}: run `gemflow ingest --date D` first"
        )
    if not date:
        return days[-1]
    try:
        day = dt.date.fromisoformat(date)
    except ValueError as err:
        raise ValueError(f"refresh date {date!r} is not a date like 2026-01-31") from err
    if day < days[0]:
        raise FileNotFoundError(f"no accepted events on or before {day} (the first partition is {days[0]})")
    return day


def active_sequences(ws: Workspace, day: dt.date, cfg: RefreshConfig, max_history: int) -> UserSequences:
    """Active users' most recent ``max_history`` accepted events up to the end of ``day``."""
    first = day - dt.timedelta(days=cfg.history_days - 1) if cfg.history_days else dt.date.min
    days = [d for d in partition_days(ws, "offline", "events") if first <= d <= day]
    events = read_events(ws, days)
    if events.empty:
        raise ValueError(f"no accepted events between {days[0] if days else first} and {day}")
    if cfg.active_days:
        since = (day - dt.timedelta(days=cfg.active_days - 1)).toordinal()
        active = np.unique(events.loc[events["day"] >= since, "user_id"].to_numpy(np.int64))
    else:
        active = np.unique(events["user_id"].to_numpy(np.int64))
    if len(active) == 0:
        raise ValueError(f"no user had an accepted event in the {cfg.active_days} day(s) up to {day}")
    seqs = UserSequences.from_histories(build_histories(events))
    return seqs.take(np.searchsorted(seqs.user_ids, active), last=max_history)


# ----------------------------------------------------------------------------------------------- encoding
@torch.inference_mode()
def encode_sequences(
    bundle: ModelBundle, seqs: UserSequences, cfg: RefreshConfig, *, desc: str | None = "embed users"
) -> np.ndarray:
    """(U, K * d) float32 user embeddings, in ``seqs`` order, batch by batch within the token budget."""
    model = bundle.model.eval()
    width = model.num_user_tokens * bundle.cfg.d_model
    out = np.zeros((len(seqs.user_ids), width), np.float32)
    plan = token_budget_batches(seqs.lengths, cfg.token_budget, cfg.max_users_per_batch)
    for rows in tqdm(plan, desc=desc, disable=desc is None, unit="batch", mininterval=1.0):
        batch = seqs.take(rows)
        history, user_id = model_inputs(bundle, batch.events(bundle.cfg.time_buckets), batch.user_ids)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            tokens = model.encode_user(history, user_id)
        out[rows] = tokens.flatten(1).float().numpy()
    return out


def _worker(rank: int, model_path: str, shard_dir: str, cfg: RefreshConfig, threads: int) -> None:
    """One process of a multi-process refresh: encode shard ``rank`` and save it next to its input."""
    torch.set_num_threads(threads)
    bundle = load_bundle(model_path)
    data = np.load(Path(shard_dir) / f"shard-{rank}.npz")
    seqs = UserSequences(
        data["user_ids"], data["offsets"], {f: data[f"v_{f}"] for f in HISTORY_FIELDS}
    )  # fmt: skip
    emb = encode_sequences(bundle, seqs, cfg, desc=f"embed users [{rank}]")
    np.save(Path(shard_dir) / f"out-{rank}.npy", emb)


def encode_parallel(bundle: ModelBundle, seqs: UserSequences, cfg: RefreshConfig) -> np.ndarray:
    """``encode_sequences`` across ``cfg.nproc`` spawned processes, each a token-balanced shard of users."""
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // cfg.nproc)
    if cfg.nproc == 1 or len(seqs.user_ids) < cfg.nproc:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return encode_sequences(bundle, seqs, cfg)
        finally:
            torch.set_num_threads(previous)
    import torch.multiprocessing as mp

    shards = shard_by_tokens(seqs.lengths, cfg.nproc)
    with tempfile.TemporaryDirectory(prefix="gemflow-refresh-") as tmp:
        model_path = Path(tmp) / "model.pt"
        save_bundle(model_path, bundle)  # workers load plain tensors (weights_only), never the registry
        for rank, rows in enumerate(shards):
            part = seqs.take(rows)
            arrays = {f"v_{f}": part.values[f] for f in HISTORY_FIELDS}
            np.savez(Path(tmp) / f"shard-{rank}.npz", user_ids=part.user_ids, offsets=part.offsets, **arrays)
        huge_pages()  # the workers' large masks and activations per batch (read by torch at their start-up)
        mp.start_processes(
            _worker, args=(str(model_path), tmp, cfg, threads), nprocs=cfg.nproc, start_method="spawn"
        )
        out = np.zeros((len(seqs.user_ids), bundle.model.num_user_tokens * bundle.cfg.d_model), np.float32)
        for rank, rows in enumerate(shards):
            out[rows] = np.load(Path(tmp) / f"out-{rank}.npy")
    return out


# ----------------------------------------------------------------------------------------------- writing
def embedding_frame(user_ids: np.ndarray, emb: np.ndarray, version: str, day: dt.date) -> pd.DataFrame:
    stamp = day_end(day)
    return pd.DataFrame(
        {
            "user_id": user_ids.astype(np.int64),
            "user_embedding": list(emb.astype(np.float32)),
            "model_version": version,
            EVENT_TS: pd.Series([stamp] * len(user_ids), dtype=pd.DatetimeTZDtype("us", "UTC")),
            CREATED_TS: pd.Series([stamp] * len(user_ids), dtype=pd.DatetimeTZDtype("us", "UTC")),
        }
    )


def write_offline(ws: Workspace, day: dt.date, frame: pd.DataFrame) -> Path:
    table = pa.Table.from_pandas(frame, schema=USER_EMBEDDING, preserve_index=False)
    return write_partition(ws.offline(EMBEDDING_TABLE, day), table, name=EMBEDDING_FILE)


def push_online(store, frame: pd.DataFrame, chunk: int) -> int:
    from feast.data_source import PushMode

    starts = range(0, len(frame), chunk)
    for start in tqdm(starts, desc="push online", unit="chunk", disable=len(starts) < 2):
        store.push(PUSH_SOURCE, frame.iloc[start : start + chunk], to=PushMode.ONLINE)
    return len(frame)


def write_retrieval_vectors(
    ws: Workspace, day: dt.date, champion: Champion, seqs: UserSequences, cfg: RefreshConfig
) -> Path | None:
    """The champion's ad vectors and every refreshed user's query for retrieval (``models.embeddings.ad_vectors``),
    versioned as the embeddings are, and the pinned model that computed them (``user_model.json``); None for a user
    model without a next-item head (nothing to retrieve with). The queries take a second pass over the histories
    (the embeddings' pass keeps only the summary tokens)."""
    bundle = champion.bundle
    if getattr(bundle.cfg, "objective", "") != "next_item":
        return None
    out = query_vectors(bundle, seqs, cfg.token_budget, cfg.max_users_per_batch)
    order = np.argsort(seqs.user_ids, kind="stable")
    folder = ws.offline(RETRIEVAL_TABLE, day)
    # first: a server that finds the ad vectors finds the model that computed them (its fresh queries' model)
    write_user_model_record(folder, UserModelRecord(champion.version, champion.uri))
    queries = UserQueries(seqs.user_ids[order].astype(np.int64), out[order], champion.version)
    write_ad_vectors(folder, queries, day, USER_QUERY_FILE)
    return write_ad_vectors(folder, ad_vectors(bundle, champion.version), day)


def summary_dir(ws: Workspace, day: dt.date) -> Path:
    return ws.reports(day) / "user_embedding"


def refresh_embeddings(ws: Workspace, cfg: RefreshConfig) -> dict:
    """Run one refresh; returns (and writes) its summary."""
    cfg.validate()
    t0 = time.perf_counter()
    day = refresh_day(ws, cfg.date)
    champion = load_champion(cfg.model_uri, cfg.tracking_uri, ws)
    max_history = champion.bundle.cfg.max_history
    seqs = active_sequences(ws, day, cfg, max_history)
    log.info(
        "refresh %s: %d users, %d events, %s", day, len(seqs.user_ids), seqs.offsets[-1], champion.version
    )

    t_encode = time.perf_counter()
    emb = encode_parallel(champion.bundle, seqs, cfg)
    encode_s = time.perf_counter() - t_encode
    frame = embedding_frame(seqs.user_ids, emb, champion.version, day)
    offline_path = write_offline(ws, day, frame)
    ad_vector_path = write_retrieval_vectors(ws, day, champion, seqs, cfg)

    later = [d for d in partition_days(ws, "offline", EMBEDDING_TABLE) if d > day]
    pushed, online_note = 0, "pushed"
    if not cfg.push_online:
        online_note = "disabled"
    elif later:
        online_note = f"skipped: the refresh of {later[-1]} is newer (backfill writes offline only)"
    else:
        from features.store import open_store

        pushed = push_online(open_store(ws, cfg.feature_store, apply=True), frame, cfg.push_chunk)

    summary = {
        "date": day.isoformat(),
        "model_uri": cfg.model_uri,
        "resolved_uri": champion.uri,
        "model_version": champion.version,
        "users": int(len(seqs.user_ids)),
        "events": int(seqs.offsets[-1]),
        "max_history": int(max_history),
        "embedding_dim": int(emb.shape[1]),
        "nproc": cfg.nproc,
        "encode_seconds": round(encode_s, 3),
        "users_per_second": round(len(seqs.user_ids) / encode_s, 1) if encode_s > 0 else None,
        "offline_path": str(offline_path),
        "ad_vectors_path": str(ad_vector_path) if ad_vector_path else None,
        "online": online_note,
        "online_rows": pushed,
        "seconds": round(time.perf_counter() - t0, 3),
        "created_at": dt.datetime.now(dt.UTC).isoformat(),
        "config": to_dict(cfg),
    }
    out = summary_dir(ws, day)
    save_config(cfg, out, "refresh_config.yaml")
    (out / "refresh_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
