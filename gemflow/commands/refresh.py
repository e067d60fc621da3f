"""Registration and embedding commands: ``register-run`` (register + gate, for the DAGs),
``refresh-embeddings`` (champion user model -> Feast) and ``check-versions``.

Exit codes: 0 done / versions agree; 1 ``check-versions`` found a mismatch (or no embeddings online), or
``register-run`` could not reach the MLflow tracking server (a retry registers no second version); 2 bad input
(unknown model, no events, bad config) with a one-line error; 4 (``UNCHANGED_EXIT``) nothing changed: the gate
kept the current champion, or there is no champion to refresh from yet. The DAGs skip the task on 4, so a
rejected challenger publishes no ``CHAMPION`` event and triggers no refresh or deploy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gemflow import logs
from gemflow.commands.common import (
    ConfigOpt,
    SetOpt,
    WorkspaceOpt,
    config,
    parse_date,
    workspace,
    write_event,
)
from gemflow.exit_codes import BAD_INPUT as BAD_INPUT_EXIT
from gemflow.exit_codes import FAILED as FAILED_EXIT  # the step ran and failed: Airflow retries it
from gemflow.exit_codes import FAILED as MISMATCH_EXIT
from gemflow.exit_codes import UNCHANGED as UNCHANGED_EXIT  # the task is skipped, its outlets publish nothing


def _fail(err: Exception) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(code=BAD_INPUT_EXIT)


def _logging() -> None:
    logs.setup()


def latest_run(ws, kind: str) -> Path:
    """The most recently written run folder under ``<ws>/models/<kind>/`` (by its model.pt)."""
    runs = sorted((ws.root / "models" / kind).glob("*/model.pt"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise FileNotFoundError(
            f"no trained {kind} model under {ws.root / 'models' / kind} (run `gemflow train`)"
        )
    return runs[-1].parent


def _run_training_set(run: Path) -> str:
    """The training set a run recorded in its config.yaml (what the gate judges on by default)."""
    import yaml

    cfg = run / "config.yaml"
    if not cfg.exists():
        raise FileNotFoundError(f"{run} has no config.yaml: pass --training-set")
    return str((yaml.safe_load(cfg.read_text()) or {}).get("training_set") or "default")


def _run_folder(client, ws, kind: str, run_dir: str, run_id: str) -> Path:
    """The run folder to register: named, found from its MLflow run id, or the newest of ``kind``."""
    from mlflow.exceptions import MlflowException

    from models.tracking import mlflow_store
    from models.tracking.training_run import recorded_run_id, run_dir_of

    if not run_id:
        return Path(run_dir) if run_dir else latest_run(ws, kind)
    try:
        folder = run_dir_of(client.get_run(run_id), ws)
    except MlflowException as err:
        if mlflow_store.unreachable(err):
            raise
        raise LookupError(f"no MLflow run {run_id} in {client.tracking_uri}") from err
    if run_dir and Path(run_dir).resolve() != folder.resolve():
        raise ValueError(f"--run-id {run_id} trained {folder}, not --run-dir {run_dir}")
    if recorded_run_id(folder) != run_id:
        raise ValueError(f"{folder} records another MLflow run than {run_id}")
    return folder


def register(app: typer.Typer) -> None:
    @app.command("register-run")
    def register_run_cmd(
        training_set: Annotated[
            str,
            typer.Option(
                "--training-set",
                "-t",
                help="Held-out data the gate judges on (name or path); default: the run's own training set.",
            ),
        ] = "",
        kind: Annotated[str, typer.Option(help="user or ranker.")] = "user",
        run_dir: Annotated[
            str,
            typer.Option("--run-dir", help="A run folder; default: the newest under <ws>/models/<kind>/."),
        ] = "",
        run_id: Annotated[
            str,
            typer.Option("--run-id", help="The MLflow training run to register (instead of --run-dir)."),
        ] = "",
        tracking_uri: Annotated[
            str,
            typer.Option(help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the workspace's)."),
        ] = "",
        min_gain: Annotated[
            float, typer.Option(help="Relative NE gain needed to replace the champion.")
        ] = 0.002,
        calibration_low: Annotated[float, typer.Option(help="Lowest acceptable calibration.")] = 0.8,
        calibration_high: Annotated[float, typer.Option(help="Highest acceptable calibration.")] = 1.25,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Register a training run (in its own MLflow run) as @challenger and gate it; exit 4 when the champion
        did not change."""
        import mlflow
        from mlflow.exceptions import MlflowException

        from models.tracking import mlflow_store
        from models.tracking.mlflow_store import connect
        from models.tracking.registry import GateConfig, register_bundle, run_gate
        from models.tracking.registry.heldout import evaluator
        from models.training.data import TrainingSetError

        _logging()
        w = workspace(ws)
        if kind not in ("user", "ranker"):
            raise _fail(ValueError(f"--kind must be user or ranker, got {kind!r}"))
        try:
            client = connect(w, tracking_uri)
            run = _run_folder(client, w, kind, run_dir, run_id)
            training_set = training_set or _run_training_set(run)
            data = Path(training_set) if Path(training_set).is_dir() else w.training(training_set)
            version = register_bundle(run, data)
            decision = run_gate(
                version.name,
                version.version,
                evaluator(data),
                GateConfig(
                    min_relative_ne_gain=min_gain,
                    calibration_low=calibration_low,
                    calibration_high=calibration_high,
                ),
            )
        except Exception as err:
            if mlflow_store.unreachable(err):  # a server down, restarting or evicted: a retry can succeed
                message = mlflow_store.unreachable_message(err, mlflow.get_tracking_uri())
                typer.echo(f"error: {message}; a retry reuses any version this attempt registered", err=True)
                raise typer.Exit(code=FAILED_EXIT) from err
            if isinstance(
                err, ValueError | LookupError | FileNotFoundError | TrainingSetError | MlflowException
            ):
                raise _fail(err) from err
            raise
        verdict = "PROMOTED to @champion" if decision.promoted else "stays @challenger"
        typer.echo(f"{version.name} v{version.version} from {run}: {verdict}: {decision.reason}")
        write_event({"model": version.name, "version": str(version.version), "run_dir": str(run),
                     "model_uri": f"models:/{version.name}/{version.version}"})  # fmt: skip
        if not decision.promoted:
            typer.echo(f"nothing to do: {version.name} v{version.version} {verdict}: {decision.reason}")
            raise typer.Exit(code=UNCHANGED_EXIT)

    @app.command("refresh-embeddings")
    def refresh_cmd(
        date: Annotated[
            str | None,
            typer.Option("--date", "-d", help="Day D (events up to its end); default: the latest."),
        ] = None,
        model_uri: Annotated[
            str | None,
            typer.Option(
                "--model-uri", help="User model: models:/gem-user-model@champion or a model.pt path."
            ),
        ] = None,
        nproc: Annotated[
            int | None, typer.Option("--nproc", help="Worker processes (shards of users).")
        ] = None,
        tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI.")] = None,
        skip_without_champion: Annotated[
            bool,
            typer.Option(help="Exit 4 (skip) instead of failing when the registry has no such alias yet."),
        ] = False,
        cfg_path: ConfigOpt = None,
        overrides: SetOpt = None,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Embed every active user with the champion user model; write the offline table and push online."""
        from mlflow.exceptions import MlflowException

        from models.embeddings.refresh import RefreshConfig, refresh_embeddings

        _logging()
        cfg = config(
            RefreshConfig, cfg_path, overrides, date=date, model_uri=model_uri, nproc=nproc,
            tracking_uri=tracking_uri,
        )  # fmt: skip
        w = workspace(ws)
        try:
            if skip_without_champion and not _champion_exists(cfg, w):
                typer.echo(f"no {cfg.model_uri} yet: nothing to refresh")
                raise typer.Exit(code=UNCHANGED_EXIT)
            summary = refresh_embeddings(w, cfg)
        except (ValueError, FileNotFoundError, LookupError, MlflowException) as err:
            raise _fail(err) from err
        summary.pop("config")
        write_event({"day": summary["date"], "user_model_version": str(summary["model_version"]),
                     "model_uri": summary["resolved_uri"]})  # fmt: skip
        typer.echo(json.dumps(summary, indent=2))

    @app.command("backfill-embeddings")
    def backfill_cmd(
        through: Annotated[
            str,
            typer.Option(help="The refreshed day whose model version the backfill matches; '' = the newest."),
        ] = "",
        nproc: Annotated[int | None, typer.Option("--nproc", help="Worker processes.")] = None,
        tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI.")] = None,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Embed every ingested day before --through with the model that refreshed --through, where missing.

        A ranker example of day d joins the embedding live at d (point in time): after a new user model the
        earlier days need its embeddings too. Days already refreshed by that version are left alone."""
        from mlflow.exceptions import MlflowException

        from models.embeddings.refresh import RefreshConfig, refresh_embeddings, summary_dir

        _logging()
        w = workspace(ws)
        refreshed = sorted(
            p.parent.parent.name[5:]
            for p in (w.root / "reports").glob("date=*/user_embedding/refresh_summary.json")
        )
        if not through and not refreshed:
            raise _fail(FileNotFoundError("no embedding refresh yet: nothing to backfill from"))
        end = parse_date(through or refreshed[-1])
        last = summary_dir(w, end) / "refresh_summary.json"
        if not last.exists():
            raise _fail(FileNotFoundError(f"{end} has no embedding refresh ({last}): refresh it first"))
        target = json.loads(last.read_text())
        done = []
        days = sorted(p.name[5:] for p in w.offline("events").glob("date=*"))
        for day in (d for d in days if d < end.isoformat()):
            summary = summary_dir(w, parse_date(day)) / "refresh_summary.json"
            if (
                summary.exists()
                and json.loads(summary.read_text()).get("model_version") == target["model_version"]
            ):
                continue
            cfg = RefreshConfig(date=day, model_uri=target["resolved_uri"])
            cfg.nproc = nproc or cfg.nproc
            if tracking_uri:
                cfg.tracking_uri = tracking_uri
            try:
                refresh_embeddings(w, cfg)
            except (ValueError, FileNotFoundError, LookupError, MlflowException) as err:
                raise _fail(err) from err
            done.append(day)
        typer.echo(json.dumps({"through": end.isoformat(), "model_version": target["model_version"],
                               "refreshed": done}))  # fmt: skip

    def _champion_exists(cfg, w) -> bool:
        from mlflow.exceptions import MlflowException

        from models.embeddings.refresh import MODEL_URI
        from models.tracking.mlflow_store import connect

        match = MODEL_URI.match(cfg.model_uri)
        if not match or not match["alias"]:
            return True  # a file or a pinned version: let the refresh itself say what is wrong
        try:
            connect(w, cfg.tracking_uri).get_model_version_by_alias(match["name"], match["alias"])
        except MlflowException:
            return False
        return True

    @app.command("check-versions")
    def check_versions_cmd(
        ranker_uri: Annotated[
            str, typer.Option("--ranker-uri", help="The ranker: models:/gem-ranker@champion or a model.pt.")
        ] = "models:/gem-ranker@champion",
        sample: Annotated[int, typer.Option(help="Users sampled from the latest refresh.")] = 200,
        users: Annotated[
            str | None, typer.Option("--users", help="Comma-separated user ids instead of a sample.")
        ] = None,
        tracking_uri: Annotated[str, typer.Option(help="MLflow tracking URI.")] = "",
        online_store: Annotated[str, typer.Option(help="sqlite (embedded) or redis.")] = "sqlite",
        redis_connection: Annotated[str, typer.Option(help="host:port when --online-store redis.")] = "",
        ws: WorkspaceOpt = None,
    ) -> None:
        """Compare the model_version of online embeddings with the user-model version the ranker expects."""
        import numpy as np
        from mlflow.exceptions import MlflowException

        from features.feature_repo import FeatureStoreConfig
        from features.store import open_store
        from models.embeddings.versions import check_versions, expected_versions, sample_users

        w = workspace(ws)
        try:
            ids = (
                np.array([int(u) for u in users.split(",") if u.strip()], np.int64)
                if users
                else sample_users(w, sample)
            )
            fs = FeatureStoreConfig(online_store=online_store)
            if redis_connection:
                fs.redis_connection = redis_connection
            ranker, expected = expected_versions(ranker_uri, tracking_uri, w)
            report = check_versions(open_store(w, fs), ranker, expected, ids)
        except (ValueError, FileNotFoundError, LookupError, MlflowException) as err:
            raise _fail(err) from err
        typer.echo(report.message())
        typer.echo(json.dumps(report.to_dict(), indent=2))
        if not report.ok:
            raise typer.Exit(code=MISMATCH_EXIT)
