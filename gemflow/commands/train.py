"""Model commands: ``train --model user|ranker`` and ``evaluate`` (NE/AUC/calibration, leave-one-out).

Both exit 2 on bad input (unknown training set, bad config, missing model) with a one-line error, 0 otherwise,
and print their metrics as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gemflow import logs
from gemflow.commands.common import ConfigOpt, SetOpt, WorkspaceOpt, config, workspace
from gemflow.exit_codes import BAD_INPUT as BAD_INPUT_EXIT
from gemflow.exit_codes import FAILED


def _logging() -> None:
    logs.setup()


def _fail(err: Exception) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(code=BAD_INPUT_EXIT)


def _train_distributed(cfg, ws) -> None:
    from models.training.data import TrainingSetError
    from models.training.distributed.launch import DistributedRunError, launch

    try:
        run_dir = launch(cfg, ws)
    except (TrainingSetError, ValueError, FileNotFoundError) as err:
        raise _fail(err) from err
    except DistributedRunError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code=FAILED) from err
    metrics = json.loads((run_dir / "metrics.json").read_text())
    typer.echo(json.dumps({"run_dir": str(run_dir), **metrics}))  # one line: one log record


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train_cmd(
        model: Annotated[
            str | None, typer.Option("--model", "-m", help="user (offline user model) or ranker.")
        ] = None,
        training_set: Annotated[
            str | None,
            typer.Option("--training-set", "-t", help="Name under <workspace>/training/ or a path."),
        ] = None,
        cfg_path: ConfigOpt = None,
        overrides: SetOpt = None,
        ws: WorkspaceOpt = None,
        nproc: Annotated[
            int | None,
            typer.Option(
                "--nproc", help="Distributed user-model training on N ranks (DeepSpeed + torchrec)."
            ),
        ] = None,
        resume: Annotated[
            bool,
            typer.Option(
                "--resume",
                help="Continue the run folder's checkpoint (refused if its model config differs); "
                "without it every invocation is a new run in a new folder.",
            ),
        ] = False,
    ) -> None:
        """Train the user model or the ranker (single process), tracked in MLflow; a new run unless --resume."""
        from models.config import TrainRunConfig
        from models.training.data import TrainingSetError
        from models.training.train import train

        _logging()
        flags = {"model": model, "training_set": training_set, "distributed.nproc": nproc,
                 "resume": True if resume else None}  # fmt: skip
        cfg = config(TrainRunConfig, cfg_path, overrides, **flags)
        if nproc is not None:  # hand off to the distributed launcher (models/training/distributed/launch.py)
            _train_distributed(cfg, workspace(ws))
            return
        from gemflow.malloc import keep_freed_memory

        keep_freed_memory()  # this process only trains: reuse freed memory, as the distributed ranks do
        try:
            result = train(cfg, workspace(ws))
        except (TrainingSetError, ValueError, FileNotFoundError) as err:
            raise _fail(err) from err
        typer.echo(
            json.dumps(
                {"run_dir": str(result.run_dir), "mlflow_run_id": result.mlflow_run_id, **result.metrics}
            )
        )

    @app.command("evaluate")
    def evaluate_cmd(
        run_dir: Annotated[Path, typer.Option("--run", "-r", help="A training run folder (holds model.pt).")],
        training_set: Annotated[
            str, typer.Option("--training-set", "-t", help="Name under <workspace>/training/ or a path.")
        ],
        split: Annotated[str, typer.Option(help="test or valid.")] = "test",
        leave_one_out: Annotated[
            bool,
            typer.Option(
                "--leave-one-out/--no-leave-one-out", help="Also rank 1 positive + 99 negatives per user."
            ),
        ] = False,
        negatives: Annotated[int, typer.Option(help="Sampled negatives per leave-one-out list.")] = 99,
        fresh_as_of: Annotated[
            str,
            typer.Option(
                help="Ranker: fresh events as the event path serves them (served) or a daily store (day)."
            ),
        ] = "served",
        ws: WorkspaceOpt = None,
    ) -> None:
        """NE, AUC and calibration of a trained model on a split; optionally leave-one-out HR@10/NDCG@10/MRR.
        A next-item model (positive-only logs) is judged by leave-one-out ranking only: sampled and full."""
        from models.inference.bundle import load_bundle
        from models.sequential.evaluate import is_next_item, next_item_metrics
        from models.training import evaluate
        from models.training.data import TrainingSet, TrainingSetError
        from models.training.prepare import resolve_training_set
        from models.training.train import evaluate_rows

        _logging()
        if split not in ("test", "valid"):
            raise _fail(ValueError(f"--split must be test or valid, got {split!r}"))
        try:
            path = resolve_training_set(training_set, workspace(ws))
            bundle = load_bundle(run_dir)
            if is_next_item(bundle):
                metrics = next_item_metrics(bundle, TrainingSet(path), split, num_negatives=negatives)
                typer.echo(json.dumps({f"{split}_{k}": v for k, v in metrics.items()}))
                return
            bundle, data, builder = evaluate.load_for_evaluation(run_dir, path, fresh_as_of)
            out = evaluate_rows(bundle.model, builder, data.split_rows(split), 1024, f"{split}_")
            if leave_one_out:
                out |= {
                    f"loo_{k}": v
                    for k, v in evaluate.leave_one_out(
                        bundle, data, builder, split=split, num_negatives=negatives
                    ).items()
                }
                pop = evaluate.popularity_leave_one_out(data, split=split, num_negatives=negatives)
                out |= {f"loo_popularity_{k}": v for k, v in pop.items()}
        except (TrainingSetError, ValueError, FileNotFoundError) as err:
            raise _fail(err) from err
        typer.echo(json.dumps(out))
