"""The in-process ad table: lookups by id, unknown ids, refresh failures keep the last good snapshot, and
snapshots built in a child process (``ProcessLoader``)."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest

from features.feature_repo.tables import STATS_KINDS
from features.store import open_store
from gemflow.workspace import Workspace
from models.training.dense import DenseSpec
from serving.ad_refresh_process import ProcessLoader
from serving.ad_table import (
    AdSnapshot,
    AdTable,
    feast_ad_loader,
    offline_ad_ids,
    sqlite_version,
)
from serving.inputs import AdArrays
from tests.serving import ad_loaders
from tests.serving.world import REQUEST_TS


def _snap():
    return AdSnapshot.from_rows(
        np.array([2, 5, 7]),
        {
            "ad_quality": np.array([0.1, 0.5, np.nan]),
            "ad_advertiser_id": np.array([1, 2, 3]),
            "ad_category_id": np.array([0, 4, 2]),
            "ctr_7d": np.array([0.01, 0.02, 0.03]),
        },  # fmt: skip
        dt.datetime(2026, 3, 3, tzinfo=dt.UTC),
    )


def test_lookup_marks_unknown_ids():
    values, known = _snap().lookup(np.array([5, 3, 7, 100, 2]), ["ad_quality", "nope"])
    assert known.tolist() == [True, False, True, False, True]
    assert (
        values[0, 0] == 0.5
        and np.isnan(values[1, 0])
        and np.isnan(values[2, 0])
        and np.isnan(values[:, 1]).all()
    )


def test_arrays_apply_the_trained_normalization_once():
    spec = DenseSpec.fit(
        pd.DataFrame({"quality": [0.1, 0.5, 0.9], "ctr_7d": [0.01, 0.02, 0.0]}), ["quality", "ctr_7d"]
    )
    arrays = AdArrays.build(_snap(), spec)
    dense, adv, cat, known = arrays.take(np.array([5, 100]))
    expected = spec.apply(pd.DataFrame({"quality": [0.5], "ctr_7d": [0.02]}))[0]  # "quality" <- "ad_quality"
    np.testing.assert_allclose(dense[0], expected, rtol=1e-6)
    np.testing.assert_allclose(
        dense[1], spec.apply(pd.DataFrame({"quality": [np.nan], "ctr_7d": [np.nan]}))[0]
    )
    assert adv.tolist() == [2, -1] and cat.tolist() == [4, -1] and known.tolist() == [True, False]
    assert arrays.missing_columns == []


def test_failed_refresh_keeps_the_last_snapshot():
    calls = {"n": 0}

    def loader():
        calls["n"] += 1
        if calls["n"] > 1:
            raise ConnectionError("store down")
        return _snap()

    table = AdTable(loader, refresh_seconds=3600)
    assert table.refresh() and table.loaded
    first = table.snapshot
    assert not table.refresh()
    assert table.snapshot is first
    status = table.status()
    assert status["ads"] == 3 and status["failures"] == 1 and "store down" in status["last_error"]
    assert status["as_of"] == "2026-03-03T00:00:00+00:00"


def test_the_initial_loader_builds_snapshots_until_the_first_one_loads():
    calls = []

    def initial():
        calls.append("initial")
        if len(calls) == 1:
            raise ConnectionError("store not up yet")
        return _snap()

    def background():
        calls.append("background")
        return _snap()

    table = AdTable(background, refresh_seconds=3600, initial_loader=initial)
    assert not table.refresh() and table.refresh() and table.refresh()
    assert calls == ["initial", "initial", "background"]  # the refresh process only once one snapshot loaded


def _child_pid(loader: ProcessLoader) -> int:
    return int(loader().columns["pid"][1])


def test_process_loader_builds_snapshots_in_one_long_lived_child():
    loader = ProcessLoader(ad_loaders.pid_loader, timeout_s=60)
    try:
        first = _child_pid(loader)
        assert first != os.getpid()
        assert _child_pid(loader) == first  # the child (and its store handle) is kept between refreshes
    finally:
        loader.close()


def test_start_spawns_the_child_and_builds_its_loader_before_the_first_refresh(tmp_path):
    log = tmp_path / "builds"
    loader = ProcessLoader(functools.partial(ad_loaders.counts_builds, log), timeout_s=60)
    table = AdTable(loader, refresh_seconds=3600, initial_loader=_snap)
    try:
        table.start()  # the first snapshot in process; the child is spawned and primed in the background
        deadline = time.monotonic() + 60
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        builder = int(log.read_text().split()[0])
        assert builder != os.getpid()
        assert _child_pid(loader) == builder  # the first refresh runs in the primed child
        assert log.read_text().split() == [str(builder)]  # its loader was built once, by the priming
    finally:
        table.stop()


def test_close_stops_a_busy_child_at_once():
    """A child still building its loader is stopped by ``close``, not left to finish (the server's exit would wait)."""
    loader = ProcessLoader(functools.partial(ad_loaders.slow_build, 120.0), timeout_s=60)
    before = {c.pid for c in psutil.Process().children()}
    loader.start()
    deadline, child = time.monotonic() + 60, None
    while child is None and time.monotonic() < deadline:
        for c in psutil.Process().children():
            with contextlib.suppress(psutil.Error):  # (a child of an earlier test may be a zombie)
                if c.pid not in before and "spawn_main" in " ".join(c.cmdline()):
                    child = c
        time.sleep(0.05)
    assert child is not None, "the refresh process was not spawned"
    t0 = time.monotonic()
    loader.close()
    child.wait(timeout=10)
    assert time.monotonic() - t0 < 10


def test_process_loader_failures_are_failed_refreshes_and_a_dead_child_is_replaced(tmp_path):
    table = AdTable(ProcessLoader(ad_loaders.unreachable_store, timeout_s=60), refresh_seconds=3600)
    try:
        assert not table.refresh()
        assert "ConnectionError: feature store unreachable" in table.status()["last_error"]
    finally:
        table.stop()
    loader = ProcessLoader(functools.partial(ad_loaders.dies_once, tmp_path / "died"), timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match="refresh process died"):
            loader()
        assert _child_pid(loader) != os.getpid()  # a new child serves the next refresh
    finally:
        loader.close()


def test_the_refresh_process_exits_when_its_server_is_killed(tmp_path):
    script = (
        "import sys; from serving.ad_refresh_process import ProcessLoader; from tests.serving import ad_loaders; "
        "loader = ProcessLoader(ad_loaders.pid_loader, timeout_s=60); "
        "print(int(loader().columns['pid'][1]), flush=True); sys.stdin.read()"
    )
    server = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              cwd=Path(__file__).resolve().parents[2], text=True)  # fmt: skip
    try:
        child = psutil.Process(int(server.stdout.readline()))
        server.kill()  # SIGKILL: no shutdown code runs in the server
        child.wait(timeout=15)
    finally:
        server.kill()
        server.wait()


def test_an_unchanged_table_keeps_its_snapshot():
    loads = iter([_snap(), None])
    table = AdTable(lambda: next(loads), refresh_seconds=3600)
    assert table.refresh() and table.refresh()
    status = table.status()
    assert status["refreshes"] == 1 and status["unchanged"] == 1 and status["ads"] == 3


def test_the_sqlite_store_is_read_again_only_after_a_commit_or_a_new_ad(world, tmp_path):
    ws = Workspace(
        shutil.copytree(world.ws.root, tmp_path / "ws")
    )  # a store of its own: this test writes to it
    store = open_store(ws)
    ids = {"extra": []}

    def ad_ids():
        return np.concatenate([offline_ad_ids(ws)(), np.array(ids["extra"], np.int64)])

    load = feast_ad_loader(store, ad_ids, "ad_candidates", version=sqlite_version(store))
    first = load()
    assert first is not None and first.num_ads == len(world.ads)
    assert load() is None and load() is None  # nothing committed since: no read

    ad = int(world.ads["ad_id"].iloc[0])
    row = world.ads[world.ads["ad_id"] == ad].drop(columns=["ad_attributes"], errors="ignore").copy()
    row["ctr_7d"] = 0.5
    row["event_timestamp"] = pd.Timestamp(REQUEST_TS, unit="s", tz="UTC")
    row["created_timestamp"] = row["event_timestamp"]
    store.write_to_online_store("ad_stats", row[["ad_id", "event_timestamp", "created_timestamp",
                                                 *[c for c in row if c.startswith(STATS_KINDS)]]])  # fmt: skip
    again = load()  # another connection committed (as a materialization or a push would)
    assert again is not None and again.columns["ctr_7d"][ad] == pytest.approx(0.5)
    assert load() is None

    ids["extra"] = [10**6]  # a new ad in the offline tables: read again, even with the store unchanged
    grown = load()
    assert grown is not None and grown.known.size == 10**6 + 1 and np.isnan(grown.columns["ctr_7d"][10**6])
    assert sqlite_version(object())() is None  # not SQLite: no version, every refresh reads


def _count(metric, child: str) -> float:
    return metric.labels(child=child)._value.get()


def test_a_killed_refresh_child_comes_back_and_is_counted():
    from serving.stats import CHILD_DEATHS, CHILD_RESTARTS

    deaths, restarts = _count(CHILD_DEATHS, "ad_refresh"), _count(CHILD_RESTARTS, "ad_refresh")
    loader = ProcessLoader(ad_loaders.pid_loader, timeout_s=60)
    pids = [_child_pid(loader)]
    try:
        for _ in range(2):
            psutil.Process(pids[-1]).kill()  # as the OOM killer would, between two refreshes
            with pytest.raises(RuntimeError, match=r"refresh process died; a new one starts in 0\.0 s"):
                loader()
            pids.append(_child_pid(loader))  # it had served: restarted at once, by the next refresh
    finally:
        loader.close()
    assert len(set(pids)) == 3
    assert _count(CHILD_DEATHS, "ad_refresh") - deaths == 2
    assert _count(CHILD_RESTARTS, "ad_refresh") - restarts == 2


def test_a_child_that_keeps_dying_is_restarted_with_backoff():
    loader = ProcessLoader(ad_loaders.always_dies, timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match=r"starts in 0\.0 s"):
            loader()
        with pytest.raises(RuntimeError, match=r"starts in 1\.0 s"):
            loader()
        with pytest.raises(
            RuntimeError, match=r"starts in [01]\.\d s"
        ):  # backing off: no child started meanwhile
            loader()
        time.sleep(1.1)
        with pytest.raises(RuntimeError, match=r"starts in 2\.0 s"):
            loader()
    finally:
        loader.close()


def test_the_refresh_child_does_not_inherit_the_parents_deleted_metrics_folder(tmp_path, monkeypatch):
    gone = tmp_path / "feast_metrics_of_a_parent_that_exited"  # Feast's folder of the process that started us
    for name in ("PROMETHEUS_MULTIPROC_DIR", "PROMETHEUS_MULTIPROCESS_DIR"):
        monkeypatch.setenv(name, str(gone))
    loader = ProcessLoader(ad_loaders.imports_feast, timeout_s=120)
    try:
        assert _child_pid(loader) != os.getpid()  # importing Feast there used to fail: FileNotFoundError
        assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(
            gone
        )  # the parent's own environment is left as it was
    finally:
        loader.close()


def test_consecutive_failures_make_the_table_stale_until_a_refresh_succeeds():
    outcomes = iter([_snap(), *[ConnectionError("down")] * 3, None])

    def load():
        out = next(outcomes)
        if isinstance(out, Exception):
            raise out
        return out

    table = AdTable(load, refresh_seconds=3600, max_failures=3)
    assert table.refresh() and not table.stale
    assert not table.refresh() and not table.refresh() and not table.stale
    assert not table.refresh() and table.stale and table.status()["failed_in_a_row"] == 3
    assert table.status()["stale"] and table.status()["ads"] == 3  # the old snapshot is still there
    assert table.refresh() and not table.stale  # unchanged is a success
