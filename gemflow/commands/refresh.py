"""Embedding commands: ``refresh-embeddings`` (champion user model -> Feast) and ``check-versions``.

Exit codes: 0 done / versions agree, 1 ``check-versions`` found a mismatch (or no embeddings online), 2 bad
input (unknown model, no events, bad config) with a one-line error.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated

import typer

from gemflow.commands.common import ConfigOpt, SetOpt, WorkspaceOpt, config, workspace

BAD_INPUT_EXIT = 2
MISMATCH_EXIT = 1


def _fail(err: Exception) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(code=BAD_INPUT_EXIT)


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("feast", "mlflow", "alembic", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def register(app: typer.Typer) -> None:
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
        try:
            summary = refresh_embeddings(workspace(ws), cfg)
        except (ValueError, FileNotFoundError, LookupError, MlflowException) as err:
            raise _fail(err) from err
        summary.pop("config")
        typer.echo(json.dumps(summary, indent=2))

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
