"""The fresh retrieval query, on a workspace the pipeline wrote (ingested days, the online store, a real embedding
refresh): computed from the online events a request reads it equals the refresh's cached query for the same
history; a live event moves it (the cached one stays); a recorded user model of another version is refused and
counted; every reason the fresh query is not used is named. Over HTTP (the serving world): the answer says which
query was used, in V1 and V2, and the server counts them."""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from features.feature_repo.offline import day_end
from features.feature_repo.online_read import online_reader
from features.recent_events import merge_online
from features.schema import ACTION_ID, ONLINE_LIST_EVENTS, SURFACE_ID
from features.store import open_store
from gemflow.workspace import Workspace
from models.config import UserModelConfig
from models.embeddings.ad_vectors import (
    RETRIEVAL_TABLE,
    USER_MODEL_FILE,
    UserModelRecord,
    read_user_model_record,
    write_user_model_record,
)
from models.embeddings.refresh import RefreshConfig, refresh_embeddings
from models.embeddings.sequences import UserSequences, query_vectors
from models.inference.bundle import ModelBundle, build_model, save_bundle
from models.training.dense import DenseSpec
from serving.client import get, post, v1_body, v2_body
from serving.retrieval.config import IndexConfig, RetrievalConfig
from serving.retrieval.eligibility import AdFilter
from serving.retrieval.service import RetrievalService, RetrievalUnavailable
from serving.stats import ServingStats
from serving.user_features import UserFeatures, parse_online_row
from tests.features.helpers import (
    DAY0,
    USERS,
    landed_days,
)

DAYS = [DAY0 + dt.timedelta(days=k) for k in range(3)]
REQUEST_TS = int(day_end(DAYS[-1]).timestamp()) + 3600
DELAY_S = 1  # the ranker's fresh_delay_s (RankerConfig's default)
NEXT_ITEM = {"d_model": 16, "num_layers": 1, "num_heads": 2, "num_user_tokens": 2, "max_history": 24,
             "objective": "next_item", "item_attributes": "none", "embedding_init": "normal"}  # fmt: skip


def user_model(vocab: dict, path: Path, seed: int, objective: str = "next_item") -> Path:
    torch.manual_seed(seed)
    model = build_model("user", UserModelConfig(**{**NEXT_ITEM, "objective": objective}), vocab, 1)
    bundle = ModelBundle("user", model, vocab, DenseSpec(["quality"], [0.0], [1.0]), 0, path.parent.name, "")
    save_bundle(path, bundle)
    return path


@pytest.fixture(scope="module")
def landed(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """Three accepted days (offline + online store), two next-item user models and a click one, and the refresh of
    the last day by ``v1``: a pristine workspace, copied per test."""
    root = tmp_path_factory.mktemp("fresh-query")
    ws = Workspace(root / "ws")
    vocab = landed_days(ws, DAYS, events_per_day=30)
    models = {
        "v1": user_model(vocab, root / "v1" / "model.pt", 1),
        "v2": user_model(vocab, root / "v2" / "model.pt", 2),
        "click": user_model(vocab, root / "click" / "model.pt", 3, objective="click"),
    }
    cfg = RefreshConfig(date=DAYS[-1].isoformat(), model_uri=str(models["v1"]), active_days=0)
    refresh_embeddings(ws, cfg)
    return ws.root, models


@pytest.fixture
def ws(landed, tmp_path) -> Workspace:
    shutil.copytree(landed[0], tmp_path / "ws")
    return Workspace(tmp_path / "ws")


def service(ws: Workspace, **kw) -> RetrievalService:
    svc = RetrievalService(RetrievalConfig(enabled=True, index=IndexConfig(kind="exact"), **kw), ws)
    svc.load()
    return svc


def read_user(ws: Workspace, user: int) -> UserFeatures:
    """The ranker's own online read of one user (``ranker_serving``, as ``UserFeatureReader`` reads it)."""
    row, _ = online_reader(open_store(ws), "ranker_serving", "user_id")([user])
    return parse_online_row(row)


def folder(ws: Workspace) -> Path:
    return ws.offline(RETRIEVAL_TABLE, DAYS[-1])


def test_the_fresh_query_equals_the_refreshs_for_the_same_history(ws, landed):
    svc = service(ws)
    snap = svc.current
    assert snap.query_model is not None and snap.query_model.version == snap.version == "local/v1"
    assert snap.query_model.one_user is not None  # the scripted one-user path, checked against the refresh's
    assert read_user_model_record(folder(ws)) == UserModelRecord("local/v1", str(landed[1]["v1"].resolve()))
    for user in USERS:
        feats = read_user(ws, user)
        # the online list is the user's whole history
        assert len(feats.recent["recent_ts"]) < ONLINE_LIST_EVENTS
        query = snap.query(user, feats, REQUEST_TS, DELAY_S, fresh=True)
        assert query.kind == "fresh" and query.fallback is None
        assert query.events == min(len(feats.recent["recent_ts"]), NEXT_ITEM["max_history"])
        np.testing.assert_allclose(query.vector, snap.queries.lookup(user), rtol=1e-5, atol=1e-6)
    assert (
        max(len(read_user(ws, u).recent["recent_ts"]) for u in USERS) > NEXT_ITEM["max_history"]
    )  # cut used
    hits, query = svc.retrieve(USERS[0], 3, AdFilter(), read_user(ws, USERS[0]), REQUEST_TS, DELAY_S)
    cached = snap.index.search(snap.queries.lookup(USERS[0]), snap.version, 3)
    assert query.kind == "fresh" and hits.ad_ids.tolist() == cached.ad_ids.tolist()


def live_event(ws: Workspace, user: int, ad: int, ts: int, event_id: int) -> None:
    """One event through the live path's merge into the user's online list (``serving.events``)."""
    from tests.features.helpers import ADS

    advertiser, category, _ = ADS[ad]
    new = pd.DataFrame({"user_id": [user], "event_id": [event_id], "ts_us": [ts * 1_000_000], "ad_id": [ad],
                        "action": [ACTION_ID["click"]], "category_id": [category],
                        "surface": [SURFACE_ID["reels"]], "advertiser_id": [advertiser]})  # fmt: skip
    merge_online(open_store(ws), new, ONLINE_LIST_EVENTS, ts * 1_000_000)


def test_a_live_event_moves_the_fresh_query_and_the_cached_one_stays(ws):
    user, event_ts = USERS[1], REQUEST_TS - 600
    svc = service(ws)
    snap = svc.current
    before = snap.query(user, read_user(ws, user), REQUEST_TS, DELAY_S, fresh=True)
    live_event(ws, user, 13, event_ts, 999_001)
    feats = read_user(ws, user)
    after = snap.query(user, feats, REQUEST_TS, DELAY_S, fresh=True)
    assert after.kind == "fresh" and after.events == min(before.events + 1, NEXT_ITEM["max_history"])
    assert not np.allclose(after.vector, before.vector, atol=1e-4)  # the user's query moved
    # the same events through the refresh's computation: the fresh query is that, not an approximation of it
    take = slice(-NEXT_ITEM["max_history"], None)
    cols = {"ad_id": "recent_ad_ids", "action": "recent_actions", "surface": "recent_surfaces",
            "category_id": "recent_category_ids", "advertiser_id": "recent_advertiser_ids", "ts": "recent_ts"}  # fmt: skip
    values = {f: feats.recent[c][take] for f, c in cols.items()}
    seqs = UserSequences(np.array([user]), np.array([0, len(values["ts"])]), values)
    np.testing.assert_allclose(
        after.vector, query_vectors(snap.query_model.bundle, seqs)[0], rtol=1e-5, atol=1e-6
    )
    # an event inside the ranker's push delay is not read yet (the ranker's cutoff: floor(ts) - delay)
    early = snap.query(user, feats, event_ts + 0.5, DELAY_S, fresh=True)
    np.testing.assert_allclose(early.vector, before.vector, rtol=1e-5, atol=1e-6)
    # cached mode answers with the refresh's query, whatever the store holds now
    cached = snap.query(user, feats, REQUEST_TS, DELAY_S, fresh=False)
    assert (cached.kind, cached.fallback) == ("cached", None)
    np.testing.assert_array_equal(cached.vector, snap.queries.lookup(user))
    off = service(ws, fresh_query=False)
    assert off.current.query_model is None  # not even loaded
    hits_off, q_off = off.retrieve(user, 4, AdFilter(), feats, REQUEST_TS, DELAY_S)
    hits_on, q_on = svc.retrieve(user, 4, AdFilter(), feats, REQUEST_TS, DELAY_S)
    assert (q_off.kind, q_on.kind) == ("cached", "fresh")
    assert not np.allclose(hits_on.scores, hits_off.scores, atol=1e-4)  # the retrieved list's scores moved


def mismatches() -> int:
    return ServingStats().snapshot()["retrieval"]["version_mismatches"]


def test_a_recorded_model_of_another_version_is_refused_and_counted(ws, landed):
    v2 = str(landed[1]["v2"])
    svc = service(ws)
    assert svc.current.version == "local/v1"
    before = mismatches()
    # the record names another version than the vectors carry
    write_user_model_record(folder(ws), UserModelRecord("local/v2", v2))
    assert not svc.load() and svc.current.version == "local/v1"  # refused: the current snapshot keeps serving
    assert mismatches() == before + 1
    assert (
        not svc.load() and mismatches() == before + 1
    )  # the same refused folder is not rebuilt and recounted
    # the record says v1 but its file is v2's: refused once loaded
    write_user_model_record(folder(ws), UserModelRecord("local/v1", v2))
    fresh = RetrievalService(RetrievalConfig(enabled=True, index=IndexConfig(kind="exact")), ws)
    assert not fresh.load() and fresh.current is None and mismatches() == before + 2
    with pytest.raises(RetrievalUnavailable):
        fresh.retrieve(USERS[0], 3, AdFilter())
    # a query of another version is refused by the index itself (counted there)
    snap = svc.current
    with pytest.raises(RuntimeError, match="query from user model 'local/v2'"):
        snap.index.search(snap.queries.lookup(USERS[0]), "local/v2", 3)
    assert mismatches() == before + 3
    # a re-run of the refresh with v2 (its record lands first, as above): once its vectors are written, it serves
    refresh_embeddings(ws, RefreshConfig(date=DAYS[-1].isoformat(), model_uri=v2, active_days=0))
    assert svc.load() and svc.current.version == svc.current.query_model.version == "local/v2"


def test_every_reason_the_fresh_query_is_not_used_is_named(ws, landed):
    snap = service(ws).current
    user = USERS[0]
    feats = read_user(ws, user)
    cases = {
        "no_features": None,  # the store read failed or timed out
        "no_events": UserFeatures(30.0, 1, 3, None, None, None),  # a profile, no events
        "incomplete_events": UserFeatures(
            30.0, 1, 3, {k: v for k, v in feats.recent.items() if k != "recent_surfaces"}, None, None
        ),  # fmt: skip
    }
    for why, got in cases.items():
        query = snap.query(user, got, REQUEST_TS, DELAY_S, fresh=True)
        assert (query.kind, query.fallback) == ("cached", why)
    before_any = snap.query(user, feats, float(DAY0.toordinal()), DELAY_S, fresh=True)  # before every event
    assert (before_any.kind, before_any.fallback) == ("cached", "no_events")
    unknown = snap.query(
        999, read_user(ws, 999), REQUEST_TS, DELAY_S, fresh=True
    )  # no events, no cached query
    assert (unknown.kind, unknown.fallback) == ("cold_start", "no_events")
    np.testing.assert_array_equal(unknown.vector, snap.cold_query)
    # no record (a folder from before it existed): cached queries only
    (folder(ws) / USER_MODEL_FILE).unlink()
    query = service(ws).current.query(user, feats, REQUEST_TS, DELAY_S, fresh=True)
    assert (query.kind, query.fallback) == ("cached", "no_model")
    # a recorded model without a next-item head
    write_user_model_record(folder(ws), UserModelRecord("local/v1", str(landed[1]["click"])))
    query = service(ws).current.query(user, feats, REQUEST_TS, DELAY_S, fresh=True)
    assert (query.kind, query.fallback) == ("cached", "no_next_item_head")
    # a recorded model that cannot be loaded
    write_user_model_record(folder(ws), UserModelRecord("local/v1", str(ws.root / "gone" / "model.pt")))
    query = service(ws).current.query(user, feats, REQUEST_TS, DELAY_S, fresh=True)
    assert (query.kind, query.fallback) == ("cached", "no_model")


# ----------------------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def world_folder(world, tmp_path_factory):
    """A refresh folder for the serving world (``tests.serving.world.write_retrieval_folder``): a next-item user
    model, its ad vectors and its users' queries. User 5, unknown to the store, has a cached query; user 6 has
    nothing."""
    from tests.serving.world import write_retrieval_folder

    root = tmp_path_factory.mktemp("world-retrieval")
    model = root / "world-um" / "model.pt"
    ads, queries = write_retrieval_folder(
        world, root / "retrieval", model, UserModelConfig(**NEXT_ITEM), seed=5, extra_users=1
    )
    return root / "retrieval", ads, queries


@pytest.fixture(scope="module")
def fresh_server(world, world_folder, tmp_path_factory):
    from tests.serving.conftest import SERVER_SETTINGS
    from tests.serving.world import free_port, running_server

    settings = (*SERVER_SETTINGS, "retrieval.enabled=true", f"retrieval.folder={world_folder[0]}",
                "retrieval.index.kind=exact", "retrieval.index.max_k=40", "retrieval.index.default_k=20")  # fmt: skip
    log = tmp_path_factory.mktemp("serve-fresh-query") / "serve.log"
    with running_server(world, free_port(), log, *settings) as base:
        yield base


def test_the_answer_says_which_query_was_used_and_the_server_counts_them(fresh_server, world_folder, world):
    from tests.serving.world import MODEL
    from tests.serving.world import REQUEST_TS as WORLD_TS

    _, ads, cached = world_folder
    ctx = {"request_ts": float(WORLD_TS), "hour": 13}
    v1 = f"{fresh_server}/v1/models/{MODEL}:predict"
    status, r = post(v1, v1_body(0, None, ctx, {"k": 10}))
    assert status == 200, r
    ret = r["retrieval"]
    assert (ret["query"], ret["query_fallback"], ret["query_events"]) == ("fresh", None, len(world.recent[0]))
    assert ret["index_version"] == ads.model_version and ret["cold_start_query"] is False
    top = ads.ad_ids[np.argsort(-(ads.vectors @ cached[0]))[:10]]  # fresh == the refresh's query: same top 10
    assert set(r["ad_ids"]) == set(top.tolist())
    status, r = post(v1, v1_body(5, None, ctx, {"k": 5}))  # unknown to the store: its cached query
    assert status == 200 and (r["retrieval"]["query"], r["retrieval"]["query_fallback"]) == (
        "cached",
        "no_events",
    )
    status, r = post(v1, v1_body(6, None, ctx, {"k": 5}))  # nothing at all
    assert status == 200 and r["retrieval"]["query"] == "cold_start" and r["retrieval"]["cold_start_query"]
    status, r = post(f"{fresh_server}/v2/models/{MODEL}/infer", v2_body(1, None, ctx, {"k": 5}))
    assert status == 200, r
    params = r["parameters"]
    assert params["retrieval.query"] == "fresh" and params["retrieval.query_events"] == len(world.recent[1])
    assert params["retrieval.query_fallback"] == ""
    status, body = get(f"{fresh_server}/v2/models/{MODEL}/stats")
    assert status == 200
    counted = body["stats"]["retrieval"]
    assert counted["queries"] == {"fresh": 2, "cached": 1, "cold_start": 1}
    assert counted["query_fallbacks"] == {"no_events": 2} and counted["version_mismatches"] == 0


@pytest.mark.integration  # a spawned scoring worker process
def test_scoring_processes_retrieve_with_the_same_fresh_query(world, world_folder):
    """With ``scoring.processes`` the read happens in the server process, retrieval there too (one read): the same
    fresh query and candidates as the threads."""
    import asyncio
    import time

    from gemflow.commands.common import config
    from serving.config import ServingConfig
    from serving.predictor import RankerPredictor
    from serving.schema import parse_request
    from tests.serving.conftest import SERVER_SETTINGS
    from tests.serving.world import REQUEST_TS as WORLD_TS

    _, ads, cached = world_folder
    settings = [*SERVER_SETTINGS, "scoring.processes=1", "retrieval.enabled=true", "retrieval.index.kind=exact",
                f"retrieval.folder={world_folder[0]}"]  # fmt: skip
    predictor = RankerPredictor(
        config(ServingConfig, None, settings, model_uri=str(world.model_path)), world.ws
    )
    assert predictor.load()
    try:
        body = {"user_id": 3, "retrieve": {"k": 10}, "context": {"request_ts": float(WORLD_TS)}}
        req = parse_request(body, 50, None, (20, 40))
        with asyncio.Runner() as runner:
            result = runner.run(predictor.answer(req, time.monotonic() + 30))
    finally:
        predictor.stop()
    ret = result["retrieval"]
    assert (ret["query"], ret["query_events"]) == ("fresh", len(world.recent[3]))
    top = ads.ad_ids[np.argsort(-(ads.vectors @ cached[3]))[:10]]
    assert set(result["ad_ids"].tolist()) == set(top.tolist())
    assert sorted(result["retrieval_rank"]) == list(range(10))
