"""The ``gemflow`` command line: one subcommand per pipeline stage.

Common options of every stage command (see ``gemflow.commands.common``): ``--config FILE.yaml`` and
repeatable ``--set key.sub=value`` overrides for the stage's dataclass config, ``--workspace PATH`` for where
data lives (default ``$GEMFLOW_HOME`` or ``./workspace``). Every run writes the config it used next to its outputs.
"""

from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer
from typer.core import TyperOption

import gemflow.commands
from gemflow.malloc import huge_pages

huge_pages()  # before any stage imports torch (none of the imports above does; gemflow.malloc)

app = typer.Typer(
    name="gemflow",
    help="Multi-stage ads ranking: event logs -> features -> user model -> ranker -> serving.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # inherited by every command's context: -h as well as --help, and each option's default in its help
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)

# The help lists commands by pipeline stage, in the order a user runs them; a command not named here (a new one)
# is listed last, under "Other".
PIPELINE = {
    "1. Platform": ["up", "status", "wait", "restart", "down", "mlflow-server"],
    "2. Data": ["generate", "land-synthetic", "import-movielens", "import-interactions", "import-sequences",
                "events", "ingest", "build-training-set"],
    "3. Training": ["train-due", "train", "evaluate", "scaling"],
    "4. Registry and embeddings": ["register-run", "rollback", "refresh-embeddings", "backfill-embeddings",
                                   "check-versions"],
    "5. Serving": ["deploy", "smoke-test", "promote", "rollback-deploy", "undeploy", "serve", "rank",
                   "retrieval-index", "skew-check", "serving-manifest"],
}  # fmt: skip


def _version(show: bool) -> None:
    if show:
        try:
            typer.echo(f"gemflow {version('gemflow')}")
        except PackageNotFoundError:  # a source tree that was never installed
            typer.echo("gemflow (not installed)")
        raise typer.Exit()


@app.callback()
def main(
    show_version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Multi-stage ads ranking: event logs -> features -> user model -> ranker -> serving."""


def _flag_type(self: TyperOption, ctx) -> str | None:
    """A flag takes no value: no type placeholder (typer 0.29 prints ``<bool>`` beside every flag)."""
    return None if self.is_flag else _option_type(self, ctx)


_option_type = TyperOption.display_type_rich
TyperOption.display_type_rich = _flag_type

for _mod in sorted(pkgutil.iter_modules(gemflow.commands.__path__), key=lambda m: m.name):
    if not _mod.name.startswith("_") and _mod.name != "common":
        importlib.import_module(f"gemflow.commands.{_mod.name}").register(app)

_ORDER = [name for names in PIPELINE.values() for name in names]
_PANEL = {name: panel for panel, names in PIPELINE.items() for name in names}
for _cmd in app.registered_commands:
    _cmd.rich_help_panel = _PANEL.get(_cmd.name, "Other")
app.registered_commands.sort(key=lambda c: _ORDER.index(c.name) if c.name in _PANEL else len(_ORDER))


if __name__ == "__main__":
    app()
