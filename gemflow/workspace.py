"""Where every stage reads and writes on the embedded defaults: one folder, versioned by partition date.

    <root>/raw/<table>/date=YYYY-MM-DD/        landed logs (generator, MovieLens, generic importer)
    <root>/offline/<table>/date=YYYY-MM-DD/    accepted rows: the Feast offline store (parquet)
    <root>/quarantine/<table>/date=YYYY-MM-DD/ rejected rows, each with the expectation it failed
    <root>/reports/date=YYYY-MM-DD/            great-expectations data docs and validation summaries
    <root>/feature_repo/                       rendered feature_store.yaml, registry, SQLite online store
    <root>/training/<name>/                    training sets (examples + jagged user histories)
    <root>/mlflow/                             tracking/registry backend and artifacts

The root is ``$GEMFLOW_HOME`` or ``./workspace``; a stage is told its root, it never guesses.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = "workspace"


def default_root() -> Path:
    return Path(os.environ.get("GEMFLOW_HOME", DEFAULT_ROOT)).resolve()


def partition_name(day: dt.date) -> str:
    return f"date={day.isoformat()}"


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def default(cls) -> Workspace:
        return cls(default_root())

    def raw(self, table: str, day: dt.date | None = None) -> Path:
        return self._part("raw", table, day)

    def offline(self, table: str, day: dt.date | None = None) -> Path:
        return self._part("offline", table, day)

    def quarantine(self, table: str, day: dt.date | None = None) -> Path:
        return self._part("quarantine", table, day)

    def reports(self, day: dt.date) -> Path:
        return self.root / "reports" / partition_name(day)

    @property
    def feature_repo(self) -> Path:
        return self.root / "feature_repo"

    def training(self, name: str) -> Path:
        return self.root / "training" / name

    @property
    def mlflow(self) -> Path:
        return self.root / "mlflow"

    def _part(self, kind: str, table: str, day: dt.date | None) -> Path:
        base = self.root / kind / table
        return base / partition_name(day) if day else base
