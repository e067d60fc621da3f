"""The ``gemflow`` command line: one subcommand per pipeline stage.

Common options of every stage command (see ``gemflow.commands.common``): ``--config FILE.yaml`` and
repeatable ``--set key.sub=value`` overrides for the stage's dataclass config, ``--workspace PATH`` for where
data lives (default ``$GEMFLOW_HOME`` or ``./workspace``). Every run writes the config it used next to its outputs.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

# Before any stage imports torch: large CPU tensors on transparent huge pages (page faults on fresh attention
# masks and activations cost as much as the attention itself in the embedding refresh; bench/refresh.py).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import typer

import gemflow.commands

app = typer.Typer(
    name="gemflow",
    help="Multi-stage ads ranking: event logs -> features -> user model -> ranker -> serving.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

for _mod in sorted(pkgutil.iter_modules(gemflow.commands.__path__), key=lambda m: m.name):
    if not _mod.name.startswith("_") and _mod.name != "common":
        importlib.import_module(f"gemflow.commands.{_mod.name}").register(app)


if __name__ == "__main__":
    app()
