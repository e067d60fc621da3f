"""Scoring in worker processes (``scoring.processes``, ``serving.scoring_processes``) against in-thread scoring on
the same predictor: the same answers; a job past its deadline is cancelled in the worker; a killed worker costs no
request taken by the other one and is replaced. Real spawned worker processes, each loading the world's model."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from gemflow.commands.common import config
from serving.config import ServingConfig
from serving.predictor import RankerPredictor
from serving.request_scorer import Cancelled, Job
from serving.schema import parse_request
from serving.scoring_processes import WorkerLost
from tests.serving.conftest import SERVER_SETTINGS
from tests.serving.world import KNOWN_USERS, REQUEST_TS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module, as a server has (the pool reads its workers' pipes on it)."""
    with asyncio.Runner() as runner:
        yield runner


@pytest.fixture(scope="module")
def predictor(world):
    cfg = config(
        ServingConfig, None, [*SERVER_SETTINGS, "scoring.processes=2"], model_uri=str(world.model_path)
    )
    pred = RankerPredictor(cfg, world.ws)
    assert pred.load()
    yield pred
    pred.stop()


def _request(user: int, seed: int):
    rng = np.random.default_rng(seed)
    cands = rng.choice(40, size=30, replace=False).tolist()
    return parse_request({"user_id": user, "candidates": cands, "context": {"request_ts": REQUEST_TS}}, 50)


def test_worker_processes_answer_like_scoring_threads(predictor, loop):
    async def main():
        ready, detail = await predictor.readiness()
        assert ready and detail["scoring_processes_alive"] == 2
        for seed, user in enumerate(KNOWN_USERS):  # normal, older-version and no-embedding users
            req = _request(user, seed)
            via_worker = await predictor.answer(req, time.monotonic() + 10)
            feats, problem = await predictor.reader.read(user)
            in_thread = predictor.rank(
                Job(req, feats, problem, time.perf_counter(), 0.0, time.monotonic() + 10)
            )
            assert via_worker["ad_ids"].tolist() == in_thread["ad_ids"].tolist()
            np.testing.assert_array_equal(via_worker["p_click"], in_thread["p_click"])
            np.testing.assert_array_equal(via_worker["p_conversion"], in_thread["p_conversion"])
            assert via_worker["fallback"] == in_thread["fallback"]
            assert via_worker["model_version"] == in_thread["model_version"]

        with pytest.raises(Cancelled):  # the worker checks the deadline before any work
            await predictor._processes.rank(
                Job(_request(0, 9), None, None, time.perf_counter(), 0.0, time.monotonic() - 1), predictor.ad_arrays(),
                True,
            )  # fmt: skip
        still_serving = await predictor.answer(_request(0, 10), time.monotonic() + 10)
        assert still_serving["ad_ids"].size == 30

    loop.run(main())


def test_a_killed_worker_is_replaced_and_the_other_keeps_serving(predictor, loop):
    async def main():
        pool = predictor._processes
        victim = pool._workers[0].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        for seed in range(4):  # the pool serves on with the other worker
            assert (await predictor.answer(_request(1, seed), time.monotonic() + 10))["ad_ids"].size == 30
        deadline = time.monotonic() + 240
        while pool.alive < 2:  # the replacement loads the model in the background
            assert time.monotonic() < deadline, "no replacement worker within 240 s"
            await asyncio.sleep(0.5)
        assert victim.pid not in {w.proc.pid for w in pool._workers}
        for seed in range(4):
            assert (await predictor.answer(_request(3, seed), time.monotonic() + 10))["ad_ids"].size == 30

    loop.run(main())


def test_a_request_whose_worker_dies_fails_with_worker_lost(predictor, loop):
    """Both workers stopped, a request sent to one of them, then both killed: the request fails with WorkerLost
    (the gateway answers 503 with Retry-After), and both are replaced."""

    async def main():
        pool = predictor._processes
        while pool.alive < 2:
            await asyncio.sleep(0.5)
        victims = [w.proc for w in pool._workers]
        for proc in victims:
            os.kill(proc.pid, signal.SIGSTOP)
        answer = asyncio.ensure_future(predictor.answer(_request(0, 1), time.monotonic() + 60))
        while not any(w.pending is not None for w in pool._workers):  # the job is in a stopped worker's pipe
            await asyncio.sleep(0.01)
        for proc in victims:
            os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(WorkerLost):
            await answer
        deadline = time.monotonic() + 240
        while pool.alive < 2:
            assert time.monotonic() < deadline, "no replacement workers within 240 s"
            await asyncio.sleep(0.5)
        assert not {p.pid for p in victims} & {w.proc.pid for w in pool._workers}
        assert (await predictor.answer(_request(1, 2), time.monotonic() + 10))["ad_ids"].size == 30

    loop.run(main())
