"""One sweep point: train it, count its FLOPs, time it, keep its result; and the process pool that runs many.

A point whose ``result.json`` exists is never trained again; a point killed mid-training resumes from its
checkpoint (``models.training.train``). Parallel points run in separate processes (spawned: a forked torch
thread pool can deadlock), each with ``threads_per_run`` torch threads.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from gemflow.config import to_dict
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.tracking.training_run import tracking_uri

log = logging.getLogger(__name__)
RESULT = "result.json"


@dataclass
class PointJob:
    """Everything one worker needs to train and measure one point (picklable)."""

    key: str
    name: str
    groups: list[str]
    cfg: TrainRunConfig  # resolved: training set path, output dir, tracking
    workspace: str
    threads: int
    flop_batch: int
    parent_run_id: str | None
    user_model_dir: str = ""  # ranker: the trained user-model point feeding its cached tokens
    serving_candidates: int = 1000
    serving_repeats: int = 20


def default_workers(threads_per_run: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, threads_per_run))


def read_result(run_dir: Path, key: str) -> dict | None:
    path = Path(run_dir) / RESULT
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    return result if result.get("key") == key else None


def run_point(job: PointJob) -> dict:
    """Train one point, count its FLOPs, time it, tag it as a child run; write and return its result."""
    import torch

    from models.inference.bundle import embed_examples, load_bundle
    from models.scaling.flops import dense_parameters, training_flops_per_example
    from models.scaling.serving_cost import serving_cost
    from models.training.data import TrainingSet
    from models.training.prepare import prepare
    from models.training.train import train

    run_dir = Path(job.cfg.output_dir)
    done = read_result(run_dir, job.key)
    if done is not None:
        return done
    point_cpu_start = time.process_time()  # the whole point: data, FLOP count, training, evaluation
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(job.threads)
    try:
        ws = Workspace(Path(job.workspace))
        embeddings = None
        if job.cfg.model == "ranker":
            embeddings = embed_examples(
                load_bundle(job.user_model_dir), TrainingSet(Path(job.cfg.training_set))
            )
        setup = prepare(job.cfg, ws, embeddings)
        flops_per_example = training_flops_per_example(setup, job.cfg, job.flop_batch)
        params = dense_parameters(setup.bundle.model)
        resumed = (run_dir / "checkpoint.pt").exists()
        load_before = os.getloadavg()[0]
        start, cpu_start = time.perf_counter(), time.process_time()
        trained = train(job.cfg, ws, embeddings)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        epochs_run = len(trained.history) - 1
        examples_seen = epochs_run * len(setup.train_rows)
        result = {
            "key": job.key,
            "name": job.name,
            "groups": sorted(job.groups),
            "model": job.cfg.model,
            "config": to_dict(job.cfg),
            "flops_per_example": flops_per_example,
            "examples_seen": examples_seen,
            "epochs_run": epochs_run,
            "compute_flops": flops_per_example * examples_seen,
            "dense_params": params,
            "wall_time_s": wall,
            "cpu_time_s": cpu,  # ~ the wall time on an idle machine (threads x wall when they all run)
            "resumed": resumed,
            "threads": job.threads,
            "load_avg_1m_at_start": load_before,
            "train_examples": len(setup.train_rows),
            "finished_at": dt.datetime.now(dt.UTC).isoformat(),
            "mlflow_run_id": trained.mlflow_run_id,
            **{k: float(v) for k, v in trained.metrics.items()},
        }
        if job.cfg.model == "ranker":
            best = load_bundle(run_dir)
            result |= serving_cost(best.model, setup.builder, setup.test_rows, job.serving_candidates,
                                   job.serving_repeats)  # fmt: skip
            result["user_model_dir"] = job.user_model_dir
        result["point_cpu_time_s"] = time.process_time() - point_cpu_start
        _tag_child(job, result)
        tmp = run_dir / f".{RESULT}.tmp"
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, run_dir / RESULT)
        return result
    finally:
        torch.set_num_threads(previous_threads)


def _tag_child(job: PointJob, result: dict) -> None:
    if not job.cfg.tracking.enabled or not result["mlflow_run_id"]:
        return
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri(job.cfg.tracking, Workspace(Path(job.workspace))))
    run_id = result["mlflow_run_id"]
    if job.parent_run_id:
        client.set_tag(run_id, "mlflow.parentRunId", job.parent_run_id)
    client.set_tag(run_id, "scaling.key", job.key)
    client.set_tag(run_id, "scaling.groups", ",".join(sorted(job.groups)))
    names = ("flops_per_example", "compute_flops", "examples_seen", "wall_time_s", "dense_params",
             "serving_ms_per_1000", "serving_flops_per_1000")  # fmt: skip
    now = int(time.time() * 1000)
    from mlflow.entities import Metric

    metrics = [Metric(n, float(result[n]), now, 0) for n in names if n in result]
    client.log_batch(run_id, metrics=metrics)


def run_points(jobs: list[PointJob], workers: int, progress: bool, desc: str) -> list[str]:
    """Run jobs (in this process when one worker, else in spawned processes); return the failures."""
    failures = []
    bar = tqdm(total=len(jobs), desc=desc, disable=not progress or not jobs)
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            try:
                run_point(job)
            except Exception as err:  # one bad point must not lose the others' results
                log.exception("point %s failed", job.name)
                failures.append(f"{job.name}: {err}")
            bar.update()
        bar.close()
        return failures
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        futures = {pool.submit(run_point, job): job for job in jobs}
        for future in as_completed(futures):
            job = futures[future]
            try:
                future.result()
            except Exception as err:
                log.error("point %s failed: %s", job.name, err)
                failures.append(f"{job.name}: {err}")
            bar.update()
    bar.close()
    return failures
