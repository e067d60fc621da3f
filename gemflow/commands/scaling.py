"""``gemflow scaling``: a grid of tracked training runs, NE-vs-compute fits, synergy / composition /
tunability experiments (``models/scaling``). Exits 2 with a one-line error on bad input."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from gemflow import logs
from gemflow.commands.common import ConfigOpt, SetOpt, WorkspaceOpt, config, workspace
from gemflow.exit_codes import BAD_INPUT as BAD_INPUT_EXIT

PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs"


def _csv(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def register(app: typer.Typer) -> None:
    @app.command("scaling")
    def scaling_cmd(
        preset: Annotated[
            str | None,
            typer.Option(
                "--preset", "-p", help="laptop | cluster (configs/scaling-<preset>.yaml); default laptop."
            ),
        ] = None,
        axes: Annotated[
            str | None, typer.Option("--axes", help="Comma list of depth,width,seq_len,diversity.")
        ] = None,
        training_set: Annotated[
            str | None,
            typer.Option("--training-set", "-t", help="Name under <workspace>/training/ or a path."),
        ] = None,
        experiments: Annotated[
            str | None,
            typer.Option(
                "--experiments", "-e", help="Comma list of synergy,composition,tunability ('' = none)."
            ),
        ] = None,
        workers: Annotated[
            int | None, typer.Option("--workers", help="Parallel runs (default cores / threads per run).")
        ] = None,
        docs_dir: Annotated[
            Path | None,
            typer.Option(
                "--docs-dir", help="Also write plots to DIR/img and the summary into DIR/scaling.md."
            ),
        ] = None,
        progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bars.")] = True,
        cfg_path: ConfigOpt = None,
        overrides: SetOpt = None,
        ws: WorkspaceOpt = None,
    ) -> None:
        """Scaling-law sweep: train the grid (resumable), fit NE vs FLOPs, print the markdown summary."""
        from models.scaling.config import ScalingConfig
        from models.scaling.runner import run_sweep
        from models.training.data import TrainingSetError

        logs.setup()
        logging.getLogger("models.training.train").setLevel(logging.WARNING)  # the sweep reports per point
        path = cfg_path or PRESETS_DIR / f"scaling-{preset or 'laptop'}.yaml"
        if not path.exists():
            typer.echo(f"error: no preset {preset!r}: {path} does not exist", err=True)
            raise typer.Exit(code=BAD_INPUT_EXIT)
        flags = {"preset": preset, "training_set": training_set, "axes_enabled": _csv(axes),
                 "experiments": _csv(experiments), "workers": workers}  # fmt: skip
        cfg = config(ScalingConfig, path, overrides, **flags)
        try:
            outcome = run_sweep(cfg, workspace(ws), workers=cfg.workers, progress=progress, docs_dir=docs_dir)
        except (TrainingSetError, ValueError, FileNotFoundError) as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(code=BAD_INPUT_EXIT) from err
        typer.echo(outcome.markdown)
        typer.echo(json.dumps({"sweep_dir": str(outcome.sweep_dir), "points": len(outcome.results)}))
