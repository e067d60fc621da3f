"""Logging of every ``gemflow`` command: our records at INFO, third-party chatter out of the way.

A command's output is read in two places: a terminal, and an Airflow task log (the DAG tasks run the CLI and relay
its lines, ``dags/gemflow_stage.StageOutput``). For the log:
- progress bars: on a terminal tqdm redraws one line; anywhere else (no TTY) every bar's redraw becomes a line, so
  bars there redraw at most every ``LOG_PROGRESS_SECONDS`` (tqdm reads its defaults from ``TQDM_*`` variables,
  which also reach the ranks and stage subprocesses a command starts);
- third-party warnings (``warnings.warn`` outside this project: DeprecationWarnings of feast, GX, torch, ...) are
  logged at DEBUG, ours at WARNING;
- records that third-party libraries send below WARNING through the root logger (fbgemm_gpu's
  ``Successfully loaded: 'fbgemm_gpu_*.so'``, one per library file) and the INFO chatter of named noisy libraries
  are shown only at DEBUG.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_PROGRESS_SECONDS = 30
NOISY = ("mlflow", "alembic", "urllib3", "DeepSpeed", "torchrec", "torch.distributed", "feast", "great_expectations",
         "numexpr", "matplotlib", "PIL", "httpx", "ibis")  # fmt: skip
PROJECT = Path(__file__).resolve().parents[1]  # the repository: gemflow/, models/, features/, serving/
OURS = tuple(
    str(PROJECT / p) for p in ("gemflow", "models", "features", "serving", "dags", "bench", "scripts")
)


def ours(path: str) -> bool:
    return path.startswith(OURS) and "site-packages" not in path


class ThirdPartyRootChatter(logging.Filter):
    """Drops sub-WARNING records that third-party code logs through the root logger (our modules log by name)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and record.levelno < logging.WARNING and not ours(record.pathname))


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    level = logging.WARNING if ours(str(filename)) else logging.DEBUG
    logging.getLogger("py.warnings").log(level, "%s:%s: %s: %s", filename, lineno, category.__name__, message)


def quiet_progress_bars() -> None:
    """Outside a terminal, progress bars redraw (= write a log line) at most every LOG_PROGRESS_SECONDS."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_MININTERVAL", str(LOG_PROGRESS_SECONDS))


def setup(level: int = logging.INFO, fmt: str = FORMAT, *, force: bool = False) -> None:
    """Configure this process's logging for a command (see the module doc); idempotent. Handlers already on the
    root logger (a test's capture) are kept unless ``force``."""
    logging.basicConfig(level=level, format=fmt, force=force)
    root = logging.getLogger()
    for handler in root.handlers:
        if not any(isinstance(f, ThirdPartyRootChatter) for f in handler.filters) and level > logging.DEBUG:
            handler.addFilter(ThirdPartyRootChatter())
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.WARNING if level > logging.DEBUG else level)
    warnings.showwarning = _show_warning
    quiet_progress_bars()
