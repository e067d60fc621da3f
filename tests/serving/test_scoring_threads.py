"""Where a request is read and scored (``serving.scoring_threads``): on a reading thread, or, with
``scoring.inline``, on the event loop itself when the server is idle and the read cannot wait."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time

import numpy as np
import pytest

from features.feature_repo.online_read import sqlite_connection
from features.store import open_store
from serving.client import get, post, v1_body
from serving.predictor import USER_SERVICE
from serving.request_scorer import Job
from serving.schema import ParsedRequest
from serving.scoring_threads import INLINE_IDLE_S, ScoringThreads
from serving.user_features import PendingRead, UserFeatureReader
from tests.serving.conftest import SERVER_SETTINGS
from tests.serving.world import HEALTHY_USERS, MODEL, REQUEST_TS, free_port, running_server


class Reader:
    """``UserFeatureReader`` as ``ScoringThreads`` uses it: ``read_now`` (None for the users in ``busy``: their
    read could wait) and ``read_then`` (the continuation on a thread of its own); every user unknown."""

    timeout_s = 5.0

    def __init__(self, busy=()):
        self.busy = set(busy)

    def read_now(self, user_id):
        return None if user_id in self.busy else (None, None)

    def read_then(self, user_id, then):
        pending = PendingRead()
        threading.Thread(target=lambda: pending.claim() and then(None, None)).start()
        return pending


def _job(user: int) -> Job:
    req = ParsedRequest(user, np.array([1, 2]), 0, None, None, False)
    return Job(req, None, None, time.perf_counter(), 0.0, time.monotonic() + 10)


def _where(job: Job) -> threading.Thread:
    assert job.fetch_ms > 0
    return threading.current_thread()


def test_an_idle_server_reads_and_scores_on_the_event_loop():
    threads = ScoringThreads(1, 1, _where, inline=True)

    async def main():
        return threading.current_thread(), await threads.answer(Reader(), _job(1))

    loop_thread, ranked_on = asyncio.run(main())
    assert ranked_on is loop_thread and threads.inlined == 1
    threads.close()


def test_threads_unless_inline_is_asked_for_and_the_read_cannot_wait():
    for inline, reader in ((False, Reader()), (True, Reader(busy={1}))):
        threads = ScoringThreads(1, 1, _where, inline=inline)

        async def main(threads=threads, reader=reader):
            return threading.current_thread(), await threads.answer(reader, _job(1))

        loop_thread, ranked_on = asyncio.run(main())
        assert ranked_on is not loop_thread and threads.inlined == 0
        threads.close()


def test_a_request_behind_another_goes_to_the_threads():
    """One request in flight on a thread, or one just answered inline: the next goes to a thread (the loop stays
    free to read, admit and shed what queues behind it); after an idle gap the loop answers again."""
    release = threading.Event()

    def rank(job: Job) -> threading.Thread:
        if job.req.user_id == 1:
            release.wait(10)
        return _where(job)

    threads, reader = ScoringThreads(2, 1, rank, inline=True), Reader(busy={1})

    async def main():
        first = asyncio.ensure_future(threads.answer(reader, _job(1)))  # its read could wait: on a thread
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(threads.answer(reader, _job(2)))  # the first is still in flight
        await asyncio.sleep(0.05)
        release.set()
        on_threads = [await first, await second]
        await asyncio.sleep(10 * INLINE_IDLE_S)
        idle = await threads.answer(reader, _job(3))
        right_after = await threads.answer(reader, _job(4))  # started as the one before ended
        return threading.current_thread(), on_threads, idle, right_after

    loop_thread, on_threads, idle, right_after = asyncio.run(main())
    assert loop_thread not in on_threads and idle is loop_thread and right_after is not loop_thread
    assert threads.inlined == 1
    threads.close()


@pytest.mark.integration
def test_read_now_reads_a_local_store_only_when_its_lock_is_free(world):
    store = open_store(world.ws)
    reader = UserFeatureReader(store, USER_SERVICE, 5.0, workers=1)
    try:
        feats, problem = reader.read_now(0)
        assert problem is None and feats.known and feats.recent is not None
        threaded, problem = asyncio.run(reader.read(0))  # the same read on a reading thread
        assert problem is None
        assert (feats.age, feats.gender, feats.country, feats.embedding_version) == (
            threaded.age, threaded.gender, threaded.country, threaded.embedding_version)  # fmt: skip
        np.testing.assert_array_equal(feats.embedding, threaded.embedding)
        assert feats.recent.keys() == threaded.recent.keys()
        for name, values in feats.recent.items():
            np.testing.assert_array_equal(values, threaded.recent[name])
        with reader.guard:  # another read, or a refresh, holds the store
            assert reader.read_now(0) is None
        conn = sqlite_connection(store)
        timeout_ms = conn.execute("PRAGMA busy_timeout").fetchone()[0]
        writer = sqlite3.connect(world.ws.feature_repo / "online_store.db", timeout=1)
        writer.execute("BEGIN EXCLUSIVE")  # another process writing: a reader would wait for the busy timeout
        try:
            t0 = time.monotonic()
            assert reader.read_now(0) is None and time.monotonic() - t0 < 0.5  # "busy" at once: not read here
        finally:
            writer.rollback()
            writer.close()
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == timeout_ms > 0  # restored for other reads
        assert reader.read_now(0)[1] is None
        networked = UserFeatureReader(store, USER_SERVICE, 5.0, workers=1, guard=contextlib.nullcontext())
        assert networked.read_now(0) is None  # a read that could hang is never made on the event loop
        networked.close()
    finally:
        reader.close()


@pytest.fixture(scope="module")
def threaded_server(world, tmp_path_factory):
    log = tmp_path_factory.mktemp("threaded-log") / "serve.log"
    with running_server(world, free_port(), log, *SERVER_SETTINGS, "scoring.inline=false") as base:
        yield base


def _inline_answers(base: str) -> int:
    return get(f"{base}/v2/models/{MODEL}/stats")[1]["inline_answers"]


@pytest.mark.integration
def test_the_event_loop_answers_what_the_threads_do(server, threaded_server):
    """The same requests, one at a time, to the shared server (``scoring.inline``, the default) and to one that
    reads and scores on threads only: the same answers to the bit; the shared one answered them on its event loop
    (``/stats``' ``inline_answers``)."""
    url = f"/v1/models/{MODEL}:predict"
    users = (*HEALTHY_USERS, 4, 99)  # the normal path, no embedding, an unknown user
    before = _inline_answers(server)
    for user in users:
        time.sleep(0.02)  # an idle gap: the request finds the server idle
        body = v1_body(user, [5, 9, 1, 30, 42], {"request_ts": float(REQUEST_TS), "surface": "reels"})
        (s1, inline), (s2, threaded) = post(server + url, body), post(threaded_server + url, body)
        assert s1 == s2 == 200, (inline, threaded)
        for key in ("ad_ids", "p_click", "p_conversion", "fallback", "embedding_version"):
            assert inline[key] == threaded[key], key
    assert _inline_answers(server) - before == len(users)
    assert _inline_answers(threaded_server) == 0
