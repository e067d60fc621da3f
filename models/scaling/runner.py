"""Running a sweep: plan the grid, train every unfinished point (in parallel), keep one result JSON per point.

Layout under ``<workspace>/scaling/<sweep>/``::

    sweep.json                 the MLflow parent run id and the config the sweep was started with
    sets/valid-<n>/            the training set with its valid split subsampled (``valid_examples``)
    sets/<actions>/            derived training sets (histories filtered to some action types)
    points/<key>/              one training run (train's outputs) + result.json once it finished
    flops.json                 FLOP counts used to plan matched-compute points (a cache)

A point whose ``result.json`` exists is never trained again (one point's training and the process pool that
runs many: ``models.scaling.point``). Each point is an MLflow child run (tag ``mlflow.parentRunId``) of the
sweep's parent run, which this module opens and closes.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

from gemflow.config import to_dict
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.scaling.composition import filter_actions, set_fingerprint
from models.scaling.config import ALL_ACTIONS, ScalingConfig, Shape, parse_actions, validate
from models.scaling.grid import Grid, SweepPoint, train_config
from models.scaling.point import PointJob, default_workers, read_result, run_points
from models.scaling.valid_split import subsample_valid
from models.tracking import mlflow_store
from models.tracking.training_run import tracking_uri

log = logging.getLogger(__name__)


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
            failures += run_points(todo, workers, progress, f"scaling {phase} points")
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
