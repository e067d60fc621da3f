"""Run suites through great-expectations checkpoints and write what they found next to the partition.

One ephemeral GX context per partition, with a data docs site on disk (``<out>/data_docs/index.html``): each
suite runs as ``Checkpoint([ValidationDefinition])`` with an ``UpdateDataDocsAction``, so the HTML report is
GX's own. Results come back in ``COMPLETE`` format, whose ``unexpected_index_list`` names the failing rows (the
frames are validated with a RangeIndex, so index labels are row positions). ``summary.json`` is ours: counts,
failure rate, every expectation's outcome, and why the gate passed or failed.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import great_expectations as gx
import numpy as np
import pandas as pd
from great_expectations.checkpoint import UpdateDataDocsAction
from great_expectations.expectations import Expectation

SUMMARY_FILE = "summary.json"
DATA_DOCS_DIR = "data_docs"
# Row indices are only ever needed for failing row-level expectations, and GX computes them only for those.
RESULT_FORMAT = {"result_format": "COMPLETE", "return_unexpected_index_query": False}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """One expectation's result, reduced to what the gate needs."""

    reason: str
    expectation_type: str
    kwargs: dict[str, Any]
    success: bool
    row_level: bool
    unexpected_count: int | None
    rows: np.ndarray  # positions of failing rows (empty for table-level expectations)
    observed_value: Any = None
    values: np.ndarray | None = None  # spark: the failing rows' values of the column, in ``rows`` order


class GxRunner:
    """An ephemeral GX context whose validations render into ``out_dir/data_docs``."""

    def __init__(
        self,
        out_dir: Path,
        *,
        data_docs: bool = True,
        engine: str = "pandas",
        index_column: str | None = None,
    ) -> None:
        """``engine`` pandas or spark (GX's datasource of that name); ``index_column`` (spark: a row-id column,
        Spark frames have no positions) names the failing rows instead of pandas' index labels."""
        self.out_dir = out_dir
        self.index_column = index_column
        self.result_format = (
            {**RESULT_FORMAT, "unexpected_index_column_names": [index_column]}
            if index_column
            else RESULT_FORMAT
        )
        self.context = gx.get_context(mode="ephemeral")
        self.context.variables.progress_bars = {"globally": False}
        self.actions = []
        if data_docs:
            self.context.add_data_docs_site(
                "gemflow",
                {
                    "class_name": "SiteBuilder",
                    "store_backend": {
                        "class_name": "TupleFilesystemStoreBackend",
                        "base_directory": str(out_dir / DATA_DOCS_DIR),
                    },
                    "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
                },
            )
            self.actions = [UpdateDataDocsAction(name="data_docs", site_names=["gemflow"])]
        sources = self.context.data_sources
        self.source = (sources.add_spark if engine == "spark" else sources.add_pandas)("raw_partitions")

    @property
    def data_docs_index(self) -> Path | None:
        return self.out_dir / DATA_DOCS_DIR / "index.html" if self.actions else None

    def run(self, name: str, frame, expectations: list[Expectation]) -> list[Outcome]:
        batch = self.source.add_dataframe_asset(name).add_batch_definition_whole_dataframe(name)
        suite = self.context.suites.add(gx.ExpectationSuite(name=name, expectations=expectations))
        definition = self.context.validation_definitions.add(
            gx.ValidationDefinition(name=name, data=batch, suite=suite)
        )
        checkpoint = self.context.checkpoints.add(
            gx.Checkpoint(
                name=name,
                validation_definitions=[definition],
                actions=self.actions,
                result_format=self.result_format,
            )
        )
        result = checkpoint.run(batch_parameters={"dataframe": frame})
        (validation,) = result.run_results.values()
        return [_outcome(r, self.index_column) for r in validation.results]


def _outcome(result: Any, index_column: str | None = None) -> Outcome:
    config = result.expectation_config
    reason = (config.meta or {}).get("reason", config.type)
    info = result.exception_info or {}
    if info.get("raised_exception"):
        # A check GX could not evaluate would otherwise read as "no failing rows": never let that pass.
        raise RuntimeError(f"great-expectations could not evaluate {reason}: {info.get('exception_message')}")
    details = result.result or {}
    row_level = "unexpected_index_list" in details or "unexpected_list" in details
    indices = details.get("unexpected_index_list") or []
    values = None
    if index_column is not None and indices:
        # Spark: one dict per failing row, its id and the value(s) it failed on.
        column = config.kwargs.get("column")
        values = np.asarray([d.get(column) for d in indices], dtype=object) if column else None
        indices = [d[index_column] for d in indices]
    if indices and isinstance(indices[0], dict):
        raise RuntimeError(f"{reason}: expected row positions from GX, got {indices[0]!r}")
    return Outcome(
        reason=reason,
        expectation_type=config.type,
        kwargs=dict(config.kwargs),
        success=bool(result.success),
        row_level=row_level,
        unexpected_count=details.get("unexpected_count"),
        rows=np.asarray(indices, dtype=np.int64),
        observed_value=details.get("observed_value"),
        values=values,
    )


def describe(outcome: Outcome) -> dict[str, Any]:
    """An expectation's outcome for summary.json (long value sets shortened)."""
    kwargs = {}
    for key, value in outcome.kwargs.items():
        if key in ("batch_id", "result_format"):
            continue
        if isinstance(value, list | tuple) and len(value) > 20:
            value = f"<{len(value)} values>"
        kwargs[key] = value
    entry: dict[str, Any] = {
        "reason": outcome.reason,
        "expectation": outcome.expectation_type,
        "kwargs": kwargs,
        "success": outcome.success,
    }
    if outcome.row_level:
        entry["unexpected_count"] = outcome.unexpected_count
    elif outcome.observed_value is not None:
        entry["observed_value"] = outcome.observed_value
    return entry


def write_summary(out_dir: Path, summary: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SUMMARY_FILE
    path.write_text(json.dumps(summary, indent=2, default=_json_default))
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date | pd.Timestamp):
        return value.isoformat()
    if isinstance(value, np.integer | np.floating | np.bool_):
        return value.item()
    return str(value)
