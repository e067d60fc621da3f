"""One index per node: the build ``gemflow retrieval-index`` writes is what servers map (never rebuilt per
process), its answers are the built index's, a newer build is a new source the reload swaps in, and a build of
another kind or of an older user-model version is not used."""

from __future__ import annotations

import numpy as np

from gemflow.workspace import Workspace
from models.embeddings.ad_vectors import AD_VECTOR_FILE, read_ad_vectors
from serving.retrieval.config import IndexConfig, RetrievalConfig
from serving.retrieval.eligibility import AdFilter
from serving.retrieval.index import build_index
from serving.retrieval.index_files import INDEX_DIR, current_index, index_meta, load_index, save_index
from serving.retrieval.service import RetrievalService, build_snapshot
from tests.serving.retrieval.test_service import ADS, write_refresh

IVF = IndexConfig(kind="ivf", ivf_lists=8, nprobe=8)


def test_a_saved_index_maps_back_and_answers_as_the_built_one(tmp_path):
    write_refresh(tmp_path, "user-model/3", 0, 0)
    query = np.random.default_rng(5).standard_normal(8).astype(np.float32)
    for cfg in (IVF, IndexConfig(kind="hnsw", hnsw_m=8, ef_search=ADS), IndexConfig(kind="exact")):
        built = build_index(read_ad_vectors(tmp_path, AD_VECTOR_FILE), cfg)
        path = save_index(built, tmp_path)
        assert current_index(tmp_path) == path and index_meta(path)["model_version"] == "user-model/3"
        mapped = load_index(path, cfg)
        assert (mapped.kind, len(mapped), mapped.path) == (cfg.kind, ADS, str(path))
        for flt in (AdFilter(), AdFilter(surface="feed")):
            want, got = (
                built.search(query, "user-model/3", 50, flt),
                mapped.search(query, "user-model/3", 50, flt),
            )
            np.testing.assert_array_equal(got.ad_ids, want.ad_ids)
            np.testing.assert_allclose(got.scores, want.scores, rtol=1e-6)
        assert mapped.nbytes == sum(f.stat().st_size for f in path.iterdir())
    builds = [d for d in (tmp_path / INDEX_DIR).iterdir() if d.is_dir()]
    assert len(builds) == 2  # older builds are removed after the newest two


def test_servers_map_the_current_build_and_swap_in_a_newer_one(tmp_path):
    ws = Workspace(tmp_path / "ws")
    folder = tmp_path / "refresh"
    write_refresh(folder, "user-model/3", 0, 0)
    first = save_index(build_index(read_ad_vectors(folder, AD_VECTOR_FILE), IVF), folder)
    servers = [
        RetrievalService(RetrievalConfig(enabled=True, folder=str(folder), index=IVF), ws) for _ in range(2)
    ]
    for server in servers:  # two server processes of one node: both map the one file
        assert server.load() and server.current.index.path == str(first)
        assert not server.load()  # nothing new
    a, b = (s.retrieve(3, 20, AdFilter())[0] for s in servers)
    np.testing.assert_array_equal(a.ad_ids, b.ad_ids)
    second = save_index(
        build_index(read_ad_vectors(folder, AD_VECTOR_FILE), IVF), folder
    )  # a refreshed build
    assert servers[0].load() and servers[0].current.index.path == str(second) and servers[0].swaps == 2


def test_a_build_that_does_not_fit_the_server_is_not_used(tmp_path):
    write_refresh(tmp_path, "user-model/3", 0, 0)
    save_index(build_index(read_ad_vectors(tmp_path, AD_VECTOR_FILE), IVF), tmp_path)
    other_kind = build_snapshot(tmp_path, IndexConfig(kind="exact"))
    assert other_kind.index.path == "" and other_kind.index.kind == "exact"  # built here, the file left alone
    write_refresh(
        tmp_path, "user-model/4", 0, 1
    )  # the vectors rewritten by a newer champion, the build not yet
    stale = build_snapshot(tmp_path, IVF)
    assert stale.index.path == "" and stale.version == "user-model/4"
