"""Serving commands: ``serve`` (our Open Inference Protocol server for the online ranker; KServe deploys it),
``rank`` (a small client) and ``serving-manifest`` (the InferenceService for a cluster, from the same config)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from gemflow.commands.common import ConfigOpt, SetOpt, WorkspaceOpt, config, workspace


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve_cmd(
        cfg_path: ConfigOpt = None,
        overrides: SetOpt = None,
        ws: WorkspaceOpt = None,
        host: Annotated[
            str | None,
            typer.Option("--host", help="Address to bind (default 127.0.0.1; 0.0.0.0 inside a pod)."),
        ] = None,
        http_port: Annotated[
            int | None, typer.Option("--http-port", help="HTTP port (default 8080).")
        ] = None,
        model_uri: Annotated[
            str | None, typer.Option("--model-uri", help="MLflow URI or a local model.pt bundle path.")
        ] = None,
    ) -> None:
        """Serve the online ranker (V1 + Open Inference Protocol V2 REST) until interrupted.

        Set GEMFLOW_SERVING_TOKEN to require ``Authorization: Bearer <token>`` on the inference routes."""
        from serving.auth import AuthError
        from serving.config import ServingConfig
        from serving.model_source import ModelLoadError
        from serving.server import serve
        from serving.server_processes import StartFailed

        cfg = config(ServingConfig, cfg_path, overrides, host=host, http_port=http_port, model_uri=model_uri)
        try:
            serve(cfg, workspace(ws))
        except (ModelLoadError, AuthError) as err:
            raise typer.BadParameter(str(err)) from err
        except StartFailed as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(code=1) from err

    @app.command("skew-check")
    def skew_check_cmd(
        training_set: Annotated[
            str,
            typer.Option("--training-set", "-t", help="Training set name (or folder) built after the days."),
        ],
        dates: Annotated[
            str | None,
            typer.Option("--dates", help="Comma-separated logged days (default: every logged day)."),
        ] = None,
        json_out: Annotated[str | None, typer.Option("--json", help="Also write the report here.")] = None,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Served features (the server's feature log) against the training-set builder's, per feature."""
        import datetime as dt
        from pathlib import Path

        from serving.skew_check import format_report, skew_check

        root = workspace(ws)
        path = Path(training_set) if Path(training_set).is_dir() else root.training(training_set)
        days = [dt.date.fromisoformat(d.strip()) for d in dates.split(",")] if dates else None
        try:
            report = skew_check(root, path, days)
        except (FileNotFoundError, ValueError) as err:
            raise typer.BadParameter(str(err)) from err
        typer.echo(format_report(report))
        if json_out:
            Path(json_out).write_text(json.dumps(report, indent=2))

    @app.command("rank")
    def rank_cmd(
        user_id: Annotated[str, typer.Option("--user", "-u", help="User id, as in your log (u_1832 or 42).")],
        candidates: Annotated[
            str | None,
            typer.Option(
                "--candidates", help="Comma-separated ad ids, as in your log; omit to retrieve them."
            ),
        ] = None,
        url: Annotated[str, typer.Option(help="Server base URL.")] = "http://127.0.0.1:8080",
        model: Annotated[str, typer.Option(help="Model name.")] = "gem-ranker",
        surface: Annotated[str | None, typer.Option(help="Context surface (feed, stories, ...).")] = None,
        protocol: Annotated[str, typer.Option(help="v1 or v2.")] = "v1",
        top: Annotated[int, typer.Option(help="How many ranked ads to print.")] = 10,
        retrieve_k: Annotated[
            int, typer.Option(help="Without --candidates: how many ads the server retrieves to rank.")
        ] = 1000,
    ) -> None:
        """Ask a running server to rank candidates for a user (or to retrieve and rank them) and print the top."""
        from serving.client import rank

        ids = None if candidates is None else [_id(c.strip()) for c in candidates.split(",") if c.strip()]
        if ids == [] or not user_id.strip():
            raise typer.BadParameter("--user and --candidates need at least one id each")
        if protocol not in ("v1", "v2"):
            raise typer.BadParameter("--protocol must be v1 or v2")
        context = {"surface": surface} if surface else None
        try:
            status, body = rank(url, model, _id(user_id.strip()), ids, context, protocol, {"k": retrieve_k})
        except OSError as err:
            raise typer.BadParameter(f"no server answering at {url}: {err}") from err
        if status != 200:
            typer.echo(f"HTTP {status}: {body.get('error', body)}", err=True)
            raise typer.Exit(1)
        if protocol == "v1":
            rows = list(zip(body["ad_ids"], body["p_click"], body["p_conversion"], strict=True))[:top]
            keys = ("model_version", "embedding_version", "ad_table_as_of", "fallback", "retrieval")
            meta = {k: body[k] for k in keys if k in body}
        else:
            out = {o["name"]: o["data"] for o in body["outputs"]}
            rows = list(zip(out["ad_ids"], out["p_click"], out["p_conversion"], strict=True))[:top]
            meta = body.get("parameters", {})
        for ad, pc, pv in rows:
            typer.echo(f"ad {ad!s:>8}  p_click {pc:.4f}  p_conversion {pv:.4f}")
        typer.echo(json.dumps(meta, indent=2))

    @app.command("retrieval-index")
    def retrieval_index_cmd(
        date: Annotated[str, typer.Option(help="The refresh day (YYYY-MM-DD); empty = the latest.")] = "",
        k: Annotated[int, typer.Option(help="Recall@K measured against exact search.")] = 1000,
        sample: Annotated[int, typer.Option(help="Users whose queries are searched.")] = 200,
        track: Annotated[bool, typer.Option(help="Log the report to MLflow (gemflow-retrieval).")] = True,
        tracking_uri: Annotated[str, typer.Option(help="MLflow tracking URI.")] = "",
        skip_without_vectors: Annotated[
            bool,
            typer.Option(help="Exit 4 (skip) when the refresh wrote no retrieval vectors (a click model)."),
        ] = False,
        cfg_path: ConfigOpt = None,
        overrides: SetOpt = None,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Build the retrieval index from a refresh's ad vectors (--set retrieval.index.*) and write it beside them
        for the servers to map, measure it (recall@K vs exact, per-query latency, size) and record it."""
        import datetime as dt

        from gemflow.exit_codes import UNCHANGED
        from models.embeddings.ad_vectors import AD_VECTOR_FILE, RETRIEVAL_TABLE
        from serving.config import ServingConfig
        from serving.retrieval.report import index_report, track_report, write_report
        from serving.retrieval.service import latest_folder

        cfg = config(ServingConfig, cfg_path, overrides)
        w = workspace(ws)
        try:
            folder = w.offline(RETRIEVAL_TABLE, dt.date.fromisoformat(date)) if date else latest_folder(w)
        except ValueError as err:
            raise typer.BadParameter(f"--date {date!r} is not a date like 2026-01-31") from err
        if skip_without_vectors and (folder is None or not (folder / AD_VECTOR_FILE).exists()):
            typer.echo("no retrieval vectors for this refresh (not a next-item user model): nothing to index")
            raise typer.Exit(code=UNCHANGED)
        if folder is None or not folder.exists():
            typer.echo(f"error: no retrieval vectors under {w.offline(RETRIEVAL_TABLE)} (run refresh-embeddings "
                       "with a next-item user model)", err=True)  # fmt: skip
            raise typer.Exit(code=2)
        report = index_report(folder, cfg.retrieval.index, k, sample)
        write_report(report)
        if track:
            report["mlflow_run_id"] = track_report(report, w, tracking_uri)
        typer.echo(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))

    @app.command("serving-manifest")
    def manifest_cmd(cfg_path: ConfigOpt = None, overrides: SetOpt = None) -> None:
        """Print the KServe InferenceService (YAML) rendered from the serving config."""
        from serving.config import ServingConfig
        from serving.manifest import render_yaml

        typer.echo(render_yaml(config(ServingConfig, cfg_path, overrides)))


def _id(text: str) -> int | str:
    """An id typed on the command line: all digits -> an integer, anything else -> the text id itself."""
    return int(text) if text.isascii() and text.isdigit() else text
