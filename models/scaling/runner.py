"""Running a sweep: plan the grid, train every unfinished point (in parallel), keep one result JSON per point.

Layout under ``<workspace>/scaling/<sweep>/``::

    sweep.json                 the MLflow parent run id and the config the sweep was started with
    sets/valid-<n>/            the training set with its valid split subsampled (``valid_examples``)
    sets/<actions>/            derived training sets (histories filtered to some action types)
    points/<key>/              one training run (train's outputs) + result.json once it finished
    flops.json                 FLOP counts used to plan matched-compute points (a cache)

A point whose ``result.json`` exists is never trained again; a point killed mid-training resumes from its
checkpoint (``models.training.train``). Each point is an MLflow child run (tag ``mlflow.parentRunId``) of the sweep's
parent run. Parallel points run in separate processes (spawned: a forked torch thread pool can deadlock),
each with ``threads_per_run`` torch threads.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import multiprocessing
import os
import resource
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from gemflow.config import to_dict
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.scaling.composition import filter_actions, set_fingerprint
from models.scaling.config import ALL_ACTIONS, ScalingConfig, Shape, parse_actions, validate
from models.scaling.grid import Grid, SweepPoint, train_config
from models.scaling.valid_split import subsample_valid
from models.tracking import mlflow_store
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


class Sweep:
    """One sweep folder: its grid, its results, its MLflow parent run."""

    def __init__(self, cfg: ScalingConfig, ws: Workspace):
        from models.training.data import TrainingSetError
        from models.training.prepare import resolve_training_set

        validate(cfg)
        self.cfg, self.ws = cfg, ws
        self.set_path = resolve_training_set(cfg.training_set, ws)
        if not (self.set_path / "examples.parquet").exists():
            raise TrainingSetError(
                f"training set {cfg.training_set!r} not found at {self.set_path} "
                "(build one with `gemflow build-training-set`)"
            )
        name = cfg.name or f"{cfg.preset}-{Path(cfg.training_set).name}"
        self.dir = ws.root / "scaling" / name
        self.name = name
        if cfg.valid_examples:
            self.set_path = subsample_valid(self.set_path, self.dir / "sets" / f"valid-{cfg.valid_examples}",
                                            cfg.valid_examples, cfg.base.optim.seed)  # fmt: skip
        self.grid = Grid(cfg, set_fingerprint(self.set_path))
        self.parent_run_id: str | None = None
        self.trained = 0  # points trained by this invocation
        self.matched: dict[str, dict] = {}  # synergy arm -> target and achieved FLOPs per example

    # ------------------------------------------------------------------------------------------- planning
    def plan(self) -> None:
        self.grid.add_axes()
        if "composition" in self.cfg.experiments:
            self.grid.add_composition()
        if "tunability" in self.cfg.experiments:
            self.grid.add_tunability()
        if "synergy" in self.cfg.experiments:
            self._plan_synergy()

    def _plan_synergy(self) -> None:
        """Each balanced step, and per axis the single-axis shape whose FLOPs per example is closest to it."""
        sc = self.cfg.synergy
        ladder = self.grid.add_synergy_ladder()
        for step, balanced in enumerate(ladder[1:], start=1):
            target = self.flops_of(balanced)
            for axis in ("depth", "width", "seq_len"):
                start = getattr(sc.start, axis)
                choices = sorted(v for v in getattr(sc, f"{axis}_choices") if v >= start)
                best, best_gap, best_flops = start, math.inf, self.flops_of(SweepPoint("user", sc.start))
                for value in choices:
                    flops = self.flops_of(SweepPoint("user", Shape(**{**vars(sc.start), axis: value})))
                    gap = abs(math.log(flops / target))
                    if gap < best_gap:
                        best, best_gap, best_flops = value, gap, flops
                    if flops > target:  # FLOPs grow with every axis: larger values only move further away
                        break
                self.grid.add_synergy_arm(axis, step, best)
                self.matched[f"{axis}-{step}"] = {"value": best, "target_flops_per_example": target,
                                                  "flops_per_example": best_flops}  # fmt: skip

    def flops_of(self, point: SweepPoint) -> float:
        """Training FLOPs per example of a user-model point (counted once, cached in flops.json)."""
        from models.scaling.flops import training_flops_per_example
        from models.training.prepare import prepare

        cache_path = self.dir / "flops.json"
        cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
        key = self.grid.key(point)
        if key not in cache:
            cfg = self.resolved_config(key, point)
            cfg.tracking.enabled = False
            cache[key] = training_flops_per_example(prepare(cfg, self.ws), cfg, self.cfg.flop_batch)
            self.dir.mkdir(parents=True, exist_ok=True)
            cache_path.write_text(json.dumps(cache, indent=2))
        return float(cache[key])

    def training_set_for(self, actions: str) -> Path:
        kept = parse_actions(actions)
        if actions == ALL_ACTIONS or set(kept) == set(parse_actions(ALL_ACTIONS)):
            return self.set_path
        return filter_actions(self.set_path, self.dir / "sets" / "_".join(kept), kept)

    def resolved_config(self, key: str, point: SweepPoint) -> TrainRunConfig:
        extra = {
            "training_set": str(self.training_set_for(point.actions)),
            "output_dir": str(self.dir / "points" / key),
            "resume": True,
            "tracking.run_name": point.name,
        }
        if point.user_point is not None:
            extra["ranker.user_model"] = str(self.dir / "points" / self.grid.key(point.user_point))
        return train_config(self.cfg.base, point, extra)

    # ------------------------------------------------------------------------------------------- running
    def results(self) -> dict[str, dict]:
        out = {}
        for key, point in self.grid.points.items():
            result = read_result(self.dir / "points" / key, key)
            if result is not None:
                result["groups"] = sorted(point.groups)  # membership follows the current plan
                result["actions"] = point.actions
                out[key] = result
        return out

    def run(self, workers: int = 0, progress: bool = True) -> dict[str, dict]:
        """Train every unfinished point (user models first, then rankers that read them)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._start_parent()
        workers = workers or self.cfg.workers or default_workers(self.cfg.threads_per_run)
        failures: list[str] = []
        for phase in ("user", "ranker"):
            todo = [self._job(k, p) for k, p in self.grid.points.items()
                    if p.model == phase and read_result(self.dir / "points" / k, k) is None]  # fmt: skip
            log.info("%s points: %d to train, %d workers", phase, len(todo), workers)
            self.trained += len(todo)
            failures += _execute(todo, workers, progress, f"scaling {phase} points")
            if failures:
                break  # rankers need their user models
        if failures:
            raise RuntimeError(f"{len(failures)} sweep point(s) failed: " + "; ".join(failures))
        return self.results()

    def _job(self, key: str, point: SweepPoint) -> PointJob:
        cfg = self.resolved_config(key, point)
        tc = self.cfg.tunability
        return PointJob(key, point.name, sorted(point.groups), cfg, str(self.ws.root), self.cfg.threads_per_run,
                        self.cfg.flop_batch, self.parent_run_id, cfg.ranker.user_model if point.model == "ranker" else "",
                        tc.serving_candidates, tc.serving_repeats)  # fmt: skip

    def record_invocation(self, command: dict) -> dict:
        """Append this command's cost to sweep.json; return the totals over every invocation so far (an
        interrupted sweep finished by a rerun is charged for both)."""
        state_path = self.dir / "sweep.json"
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        stamp = {"finished_at": dt.datetime.now(dt.UTC).isoformat(), **command}
        state["invocations"] = [*state.get("invocations", []), stamp]
        state_path.write_text(json.dumps(state, indent=2))
        calls = state["invocations"]
        return {
            "count": len(calls),
            **{k: sum(c[k] for c in calls) for k in ("wall_s", "cpu_s", "trained_points")},
        }

    # ------------------------------------------------------------------------------------------- tracking
    def _client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri(self.cfg.base.tracking, self.ws))

    def _start_parent(self) -> None:
        """Create (or, on a rerun, reopen) the sweep's MLflow parent run."""
        state_path = self.dir / "sweep.json"
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        if not self.cfg.base.tracking.enabled:
            return
        from mlflow.exceptions import MlflowException

        client = self._client()
        run_id = state.get("parent_run_id")
        if run_id:
            try:
                client.get_run(run_id)
                client.update_run(run_id, status="RUNNING")
            except MlflowException:
                run_id = None
        if not run_id:
            run_id = client.create_run(
                self._experiment_id(client), run_name=f"scaling-{self.name}"
            ).info.run_id
            client.log_param(run_id, "preset", self.cfg.preset)
            client.log_param(run_id, "training_set", str(self.set_path))
            client.log_param(run_id, "axes", ",".join(self.cfg.axes_enabled))
            client.log_param(run_id, "experiments", ",".join(self.cfg.experiments) or "-")
        self.parent_run_id = run_id
        state.update(parent_run_id=run_id, config=to_dict(self.cfg))
        state_path.write_text(json.dumps(state, indent=2))

    def _experiment_id(self, client) -> str:
        tc = self.cfg.base.tracking
        return mlflow_store.experiment_id(
            client, tc.experiment, mlflow_store.resolve(self.ws, tc.tracking_uri)
        )

    def finish_parent(self, metrics: dict[str, float], artifacts: list[Path]) -> None:
        if not self.parent_run_id:
            return
        client = self._client()
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        finite = [Metric(k, float(v), now, 0) for k, v in metrics.items() if v == v and abs(v) != math.inf]
        client.log_batch(self.parent_run_id, metrics=finite)
        for path in artifacts:
            client.log_artifact(self.parent_run_id, str(path))
        client.set_terminated(self.parent_run_id)


def _execute(jobs: list[PointJob], workers: int, progress: bool, desc: str) -> list[str]:
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


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the spawned workers, once joined)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class SweepOutcome:
    sweep_dir: Path
    results: dict[str, dict]
    summary: dict
    markdown: str
    plots: list[Path]


def run_sweep(cfg: ScalingConfig, ws: Workspace, *, workers: int = 0, progress: bool = True,
              docs_dir: Path | None = None) -> SweepOutcome:  # fmt: skip
    """Plan, train what is missing, fit, plot, summarize; log the summary to the parent run.

    ``docs_dir``: also write the plots to ``<docs_dir>/img/`` and the summary into ``<docs_dir>/scaling.md``
    (the section of this sweep only).
    """
    from models.scaling import report

    wall_start, cpu_start = time.perf_counter(), _cpu_seconds()
    sweep = Sweep(cfg, ws)
    sweep.plan()
    results = sweep.run(workers, progress)
    summary = report.analyze(cfg, results, sweep.matched)
    # this invocation only (a rerun that skips finished points costs little); CPU summed over the workers
    summary["command"] = {"wall_s": time.perf_counter() - wall_start, "cpu_s": _cpu_seconds() - cpu_start,
                          "trained_points": sweep.trained, "cores": default_workers(1)}  # fmt: skip
    summary["invocations"] = sweep.record_invocation(summary["command"])
    prefix = f"scaling-{sweep.name}"
    plots = report.plot_all(summary, sweep.dir / "plots", prefix)
    md = report.markdown(summary, f"Sweep `{sweep.name}`", plots, sweep.dir)
    (sweep.dir / "summary.md").write_text(md)
    (sweep.dir / "results.json").write_text(json.dumps(list(results.values()), indent=2))
    if docs_dir is not None:
        import shutil

        img_dir = Path(docs_dir) / "img"
        img_dir.mkdir(parents=True, exist_ok=True)
        published = [Path(shutil.copy(p, img_dir / p.name)) for p in plots]
        report.write_section(Path(docs_dir) / "scaling.md", sweep.name,
                             report.markdown(summary, f"Sweep `{sweep.name}`", published, Path(docs_dir)))  # fmt: skip
    sweep.finish_parent(report.headline_metrics(summary),
                        [*plots, sweep.dir / "summary.md", sweep.dir / "results.json"])  # fmt: skip
    return SweepOutcome(sweep.dir, results, summary, md, plots)
