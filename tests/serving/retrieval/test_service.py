"""The server's retrieval service: the newest refresh folder is found, a reload swaps a complete index in while
searches run (every answer comes wholly from one index), a folder mixing versions is refused."""

from __future__ import annotations

import datetime as dt
import threading

import numpy as np
import pytest

from gemflow.workspace import Workspace
from models.embeddings.ad_vectors import (
    RETRIEVAL_TABLE,
    USER_QUERY_FILE,
    AdVectors,
    UserQueries,
    write_ad_vectors,
)
from serving.retrieval.config import IndexConfig, RetrievalConfig
from serving.retrieval.eligibility import AdFilter
from serving.retrieval.service import RetrievalService, RetrievalUnavailable, build_snapshot, latest_folder

DIM, ADS = 8, 400


def write_refresh(folder, version: str, first_ad: int, seed: int, user_version: str | None = None) -> None:
    """A refresh's output: ads first_ad.. first_ad + ADS, users 0..9."""
    rng = np.random.default_rng(seed)
    ads = AdVectors(np.arange(first_ad, first_ad + ADS, dtype=np.int64),
                    rng.standard_normal((ADS, DIM)).astype(np.float32), version)  # fmt: skip
    users = UserQueries(np.arange(10, dtype=np.int64), rng.standard_normal((10, DIM)).astype(np.float32),
                        user_version or version)  # fmt: skip
    write_ad_vectors(folder, users, name=USER_QUERY_FILE)
    write_ad_vectors(folder, ads)


def test_the_newest_refresh_is_loaded_and_a_newer_one_swapped_in(tmp_path):
    ws = Workspace(tmp_path / "ws")
    assert latest_folder(ws) is None
    service = RetrievalService(RetrievalConfig(enabled=True, index=IndexConfig(kind="exact")), ws)
    with pytest.raises(RetrievalUnavailable):
        service.retrieve(0, 5, AdFilter())
    write_refresh(ws.offline(RETRIEVAL_TABLE, dt.date(2026, 3, 1)), "user-model/3", 0, 0)
    assert service.load() and service.current.version == "user-model/3"
    assert not service.load()  # the same folder: nothing rebuilt
    write_refresh(ws.offline(RETRIEVAL_TABLE, dt.date(2026, 3, 2)), "user-model/4", 10_000, 1)
    assert service.load() and service.current.version == "user-model/4" and service.swaps == 2
    hits, query = service.retrieve(3, 5, AdFilter())
    assert (hits.ad_ids >= 10_000).all() and hits.model_version == "user-model/4"
    assert (query.kind, query.fallback) == ("cached", "no_model")  # the folder records no user model


def test_a_swap_under_load_answers_every_search_from_one_complete_index(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    write_refresh(old, "user-model/3", 0, 0)
    write_refresh(new, "user-model/4", 10_000, 1)
    cfg = IndexConfig(kind="hnsw", hnsw_m=8, ef_search=ADS)
    snapshots = [build_snapshot(old, cfg), build_snapshot(new, cfg)]
    service = RetrievalService(RetrievalConfig(enabled=True, index=cfg), Workspace(tmp_path / "ws"))
    service.swap(snapshots[0])
    answers, errors, stop = [], [], threading.Event()

    def search():
        while not stop.is_set():
            try:
                answers.append(service.retrieve(int(np.random.randint(0, 12)), 50, AdFilter()))
            except Exception as err:  # noqa: BLE001 (any failure under a swap is what this test looks for)
                errors.append(err)

    threads = [threading.Thread(target=search) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(200):  # swap back and forth while the searches run
        service.swap(snapshots[(i + 1) % 2])
    stop.set()
    for t in threads:
        t.join()
    assert not errors and len(answers) > 0
    for hits, _ in answers:
        assert len(hits.ad_ids) == 50
        low = hits.ad_ids < 10_000  # the old catalog's ids, or the new one's: never a mix
        assert low.all() if hits.model_version == "user-model/3" else not low.any()
    assert {hits.model_version for hits, _ in answers} <= {"user-model/3", "user-model/4"}


def test_a_folder_mixing_versions_is_refused(tmp_path):
    write_refresh(tmp_path, "user-model/4", 0, 0, user_version="user-model/3")
    with pytest.raises(
        ValueError, match="user queries of 'user-model/3' beside ad vectors of 'user-model/4'"
    ):
        build_snapshot(tmp_path, IndexConfig(kind="exact"))
