"""Paused ads and surfaces come from the source tables (``ad_serving``, written by ingest from the ads source;
advertisers from ``ad_attributes``): the eligibility aligned with the index's rows, the reload re-reading them
when they change without rebuilding the index, and, over HTTP, a filtered request that gets K eligible ads or
says why not."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pytest

from features.feature_repo.offline import write_partition
from features.schema import SURFACE_ID, SURFACES
from features.stats import ad_serving_table
from gemflow.workspace import Workspace
from models.embeddings.ad_vectors import USER_QUERY_FILE, AdVectors, UserQueries, write_ad_vectors
from serving.client import post, v1_body, v2_body
from serving.retrieval.config import IndexConfig, RetrievalConfig
from serving.retrieval.eligibility import AdFilter, OfflineEligibility
from serving.retrieval.service import RetrievalService
from tests.serving.conftest import SERVER_SETTINGS
from tests.serving.retrieval.test_service import write_refresh
from tests.serving.world import (
    DAY,
    HEALTHY_USERS,
    MODEL,
    REQUEST_TS,
    USER_MODEL_VERSION,
    build_world,
    free_port,
    running_server,
)

CTX = {"request_ts": float(REQUEST_TS), "hour": 13}


def write_serving(ws: Workspace, day: dt.date, ad_ids, paused=(), only_on: dict | None = None) -> None:
    """The ads source's serving columns for ``ad_ids``: ``paused`` ads, ``only_on`` {ad: [surfaces]} (others:
    every surface), through the table builder ingest uses."""
    only_on = only_on or {}
    ads = pd.DataFrame({"ad_id": np.asarray(ad_ids, np.int64),
                        "created_ts": pd.Timestamp(dt.datetime.combine(day, dt.time(), tzinfo=dt.UTC)),
                        "paused": [int(a) in set(paused) for a in ad_ids],
                        "surfaces": [only_on.get(int(a), list(SURFACES)) for a in ad_ids]})  # fmt: skip
    write_partition(ws.offline("ad_serving", day), ad_serving_table(ads, day))


def test_the_tables_columns_line_up_with_the_index_rows(tmp_path):
    ws = Workspace(tmp_path)
    write_serving(ws, DAY, [3, 1, 2, 7], paused=[2], only_on={7: ["reels"], 1: ["feed", "search"]})
    elig = OfflineEligibility(ws).build(np.array([1, 2, 3, 7, 9], np.int64))  # 9: in no table
    assert elig.mask(AdFilter()).tolist() == [True, False, True, True, True]
    assert elig.mask(AdFilter(surface="reels")).tolist() == [False, False, True, True, True]
    assert elig.mask(AdFilter(surface="search")).tolist() == [True, False, True, False, True]
    assert elig.surfaces[3] == 1 << SURFACE_ID["reels"] and elig.advertiser.tolist() == [-1] * 5


def test_a_changed_table_is_reread_on_reload_and_the_index_kept(tmp_path):
    ws = Workspace(tmp_path / "ws")
    folder = tmp_path / "refresh"
    write_refresh(folder, "user-model/3", 0, 0)  # ads 0..399
    write_serving(ws, DAY, range(400))
    service = RetrievalService(
        RetrievalConfig(enabled=True, folder=str(folder), index=IndexConfig(kind="exact")),
        ws,
        OfflineEligibility(ws),
    )
    assert service.load() and not service.load()
    ann = service.current.index.ann
    before = service.retrieve(3, 5, AdFilter())[0].ad_ids
    write_serving(ws, DAY + dt.timedelta(days=1), range(400), paused=before[:2].tolist())
    assert service.load() and service.current.index.ann is ann  # new eligibility, the same index structures
    after = service.retrieve(3, 5, AdFilter())[0].ad_ids
    assert (
        not set(after.tolist()) & set(before[:2].tolist())
        and len(after) == 5
        and after.tolist()[:3] == before[2:].tolist()
    )


# ------------------------------------------------------------------------------------------------- over HTTP
PAUSED, REELS_ONLY = [0, 1, 2, 3], [10, 11, 12]  # every other ad: not on reels


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A world of its own (its ``ad_serving`` table differs from the shared one's), with a retrieving server."""
    world = build_world(tmp_path_factory.mktemp("eligibility"))
    ad_ids = world.ads["ad_id"].to_numpy(np.int64)
    not_on_reels = [s for s in SURFACES if s != "reels"]
    only_on = {int(a): (["reels"] if a in REELS_ONLY else not_on_reels) for a in ad_ids}
    only_on.update({a: list(SURFACES) for a in PAUSED})
    write_serving(world.ws, DAY, ad_ids, paused=PAUSED, only_on=only_on)
    rng = np.random.default_rng(4)
    folder = tmp_path_factory.mktemp("vectors")
    ads = AdVectors(ad_ids, rng.standard_normal((len(ad_ids), 8)).astype(np.float32), USER_MODEL_VERSION)
    users = np.array(HEALTHY_USERS, np.int64)
    write_ad_vectors(folder, UserQueries(users, rng.standard_normal((len(users), 8)).astype(np.float32),
                                         USER_MODEL_VERSION), name=USER_QUERY_FILE)  # fmt: skip
    write_ad_vectors(folder, ads)
    settings = (*SERVER_SETTINGS, "retrieval.enabled=true", f"retrieval.folder={folder}",
                "retrieval.index.kind=exact", "retrieval.index.max_k=60", "retrieval.index.default_k=20")  # fmt: skip
    with running_server(world, free_port(), tmp_path_factory.mktemp("log") / "serve.log", *settings) as base:
        yield base, world


def test_paused_ads_are_never_retrieved(served):
    base, world = served
    status, r = post(
        f"{base}/v1/models/{MODEL}:predict", v1_body(0, None, {**CTX, "surface": "feed"}, {"k": 60})
    )
    assert status == 200, r
    eligible = len(world.ads) - len(PAUSED) - len(REELS_ONLY)
    assert not set(r["ad_ids"]) & set(PAUSED + REELS_ONLY) and len(r["ad_ids"]) == eligible
    ret = r["retrieval"]
    assert ret["eligible"] == eligible and ret["retrieved"] == eligible
    assert ret["short_of_k"] == f"only {eligible} ads are eligible under this filter (asked for 60)"


def test_a_surface_gets_its_own_ads_and_k_is_met_or_explained(served):
    base, _ = served
    body = v2_body(1, None, {**CTX, "surface": "reels"}, {"k": 3})
    status, r = post(f"{base}/v2/models/{MODEL}/infer", body)
    assert status == 200, r
    out = {o["name"]: o["data"] for o in r["outputs"]}
    assert sorted(out["ad_ids"]) == REELS_ONLY and r["parameters"]["retrieval.short_of_k"] == ""  # K met
    status, r = post(
        f"{base}/v1/models/{MODEL}:predict", v1_body(1, None, {**CTX, "surface": "reels"}, {"k": 5})
    )
    assert status == 200 and sorted(r["ad_ids"]) == REELS_ONLY
    assert r["retrieval"]["short_of_k"] == "only 3 ads are eligible under this filter (asked for 5)"
    status, r = post(f"{base}/v1/models/{MODEL}:predict", v1_body(1, None, {**CTX, "surface": "billboard"}))
    assert (
        status == 400 and set(r) == {"error"} and "context.surface: 'billboard' is not one of" in r["error"]
    )
