"""The validation gate: split a raw partition into accepted rows and quarantined rows, or stop the pipeline.

``validate_partition`` runs two great-expectations suites (``features.validation.suites``): the schema suite on
the raw frame (columns exist, text parses as its type, volume vs the previous partition), then the contract
suite on the coerced frame. GX's ``unexpected_index_list`` of each failing expectation names the rows it
rejects; a row failing several gets the first reason in suite order. Every input row ends up in exactly one of
``accepted`` (exact contract types) and ``quarantined`` (original values + ``reason``).

The partition fails, with ``ValidationGateError``, when the share of quarantined rows exceeds
``GateConfig.max_failure_rate``, when it is much smaller than the previous accepted partition, or when a contract
column is missing. The report (GX data docs + ``summary.json``) is written before returning or raising.

The volume rule (rows >= ``min_volume_ratio`` x the previous accepted partition's rows) is set per run, so per
source: a steady production log keeps the default (0.2: a day that lost 80% of its rows is incomplete), while a
log whose quiet days are real (MovieLens: 927 ratings one day, 124 the next) sets ``min_volume_ratio: 0``
(no volume rule) or ``min_volume_baseline: N`` (no rule after a previous partition of fewer than N rows, where
swings are noise). ``configs/movielens-ingest.yaml`` is the MovieLens setting.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from features.schema import SCHEMAS
from features.validation import parsing, suites
from features.validation.reference import registered_reference
from features.validation.report import GxRunner, Outcome, describe, write_summary

log = logging.getLogger(__name__)

UNIQUE = "expect_column_values_to_be_unique"


@dataclass
class GateConfig:
    max_failure_rate: float = 0.05  # quarantined share above which the partition fails the gate
    min_volume_ratio: float = 0.2  # rows must reach this fraction of the previous accepted partition (0: off)
    min_volume_baseline: int = 0  # no volume rule when the previous accepted partition had fewer rows
    clock_skew: dt.timedelta = dt.timedelta(minutes=5)  # allowance before a timestamp counts as future
    data_docs: bool = True  # render GX data docs HTML (summary.json is always written)
    # timestamps before this (UTC) are quarantined: negative epochs, 1970 placeholders (MovieLens-100K is 1997)
    min_ts: str = "1990-01-01"

    def __post_init__(self) -> None:
        if isinstance(self.clock_skew, int | float):  # seconds, as a YAML config writes it
            self.clock_skew = dt.timedelta(seconds=self.clock_skew)
        if not isinstance(self.clock_skew, dt.timedelta) or self.clock_skew < dt.timedelta(0):
            raise ValueError(
                f"clock_skew must be a non-negative timedelta (or seconds), got {self.clock_skew!r}"
            )
        try:
            _ = self.earliest
        except ValueError as err:
            raise ValueError(f"min_ts must be a date or time like 1990-01-01, got {self.min_ts!r}") from err
        if not 0.0 <= self.max_failure_rate <= 1.0:
            raise ValueError(f"max_failure_rate must be in [0, 1], got {self.max_failure_rate}")
        if self.min_volume_ratio < 0.0:
            raise ValueError(f"min_volume_ratio must be >= 0, got {self.min_volume_ratio}")
        if isinstance(self.min_volume_baseline, bool) or not isinstance(self.min_volume_baseline, int):
            raise ValueError(f"min_volume_baseline must be an integer, got {self.min_volume_baseline!r}")
        if self.min_volume_baseline < 0:
            raise ValueError(f"min_volume_baseline must be >= 0, got {self.min_volume_baseline}")

    @property
    def earliest(self) -> dt.datetime:
        """``min_ts`` as an aware UTC datetime."""
        earliest = dt.datetime.fromisoformat(str(self.min_ts))
        return earliest if earliest.tzinfo else earliest.replace(tzinfo=dt.UTC)


@dataclass
class GateResult:
    table: str
    accepted: pd.DataFrame  # exact schema types of features.schema.SCHEMAS[table]
    quarantined: pd.DataFrame  # original columns (as strings where unparseable) + "reason"
    counts: dict[str, int]  # reason -> quarantined rows
    failure_rate: float
    report_dir: Path
    errors: list[str] = field(default_factory=list)  # why the partition failed the gate (empty: it passed)
    summary_path: Path | None = None
    data_docs: Path | None = None

    @property
    def accepted_rows(self) -> int:
        return len(self.accepted)

    @property
    def quarantined_rows(self) -> int:
        return len(self.quarantined)


class ValidationGateError(ValueError):
    """The partition is too bad to load (or its volume dropped); ``.result`` holds the split and the report."""

    def __init__(self, message: str, result: GateResult) -> None:
        super().__init__(message)
        self.result = result


def validate_partition(
    table: str,
    raw: pd.DataFrame,
    *,
    day: dt.date,
    report_dir: Path,
    ads: pd.DataFrame | None = None,
    previous_count: int | None = None,
    now: dt.datetime | None = None,
    config: GateConfig = GateConfig(),
) -> GateResult:
    """Validate one raw partition of ``table``; the report goes to ``report_dir/<table>/``."""
    started = time.perf_counter()
    if table not in SCHEMAS:
        raise ValueError(f"unknown table {table!r}; known: {sorted(SCHEMAS)}")
    if not isinstance(raw, pd.DataFrame):
        raise TypeError(f"raw must be a pandas DataFrame, got {type(raw).__name__}")
    if raw.columns.duplicated().any():
        raise ValueError(
            f"{table}: duplicate column name(s) {sorted(set(raw.columns[raw.columns.duplicated()]))}"
        )
    now = utc_now(now)
    schema = SCHEMAS[table]
    frame = raw.reset_index(drop=True)  # GX reports index labels: make them row positions
    out_dir = Path(report_dir) / table
    runner = GxRunner(out_dir, data_docs=config.data_docs)
    reasons = _RowReasons(len(frame))

    min_rows = suites.min_rows_for(previous_count, config.min_volume_ratio, config.min_volume_baseline)
    checks = parsing.parse_checks(frame, schema)
    outcomes = runner.run(f"{table}_schema", frame, suites.schema_suite(table, checks, min_rows=min_rows))
    missing = [o for o in outcomes if o.expectation_type == "expect_column_to_exist" and not o.success]
    volume = [o for o in outcomes if o.expectation_type == "expect_table_row_count_to_be_between"]

    if missing:
        # Without a contract column no row can be judged: the whole partition goes to quarantine.
        reasons.assign(missing[0].reason, np.arange(len(frame)))
        accepted = parsing.empty_contract(schema)
    else:
        for outcome in outcomes:
            reasons.add(outcome)
        typed = _typed_frame(frame, schema, checks, reasons)
        with ads_reference_handle(table, ads) as ads_reference:
            rules = suites.contract_suite(
                table, day=day, now=now, clock_skew=config.clock_skew, ads_reference=ads_reference,
                earliest=config.earliest,
            )  # fmt: skip
            contract_outcomes = runner.run(table, typed, rules)
        for outcome in contract_outcomes:
            if outcome.expectation_type == UNIQUE:
                outcome = _later_duplicates(outcome, typed)
            reasons.add(outcome)
            outcomes.append(outcome)
        accepted = parsing.to_contract(typed.iloc[reasons.clean_rows()], schema)

    quarantined = _quarantine_frame(frame, reasons)
    counts = reasons.counts()
    failure_rate = len(quarantined) / len(frame) if len(frame) else 0.0
    errors = gate_errors(table, len(frame), failure_rate, config, missing, volume, previous_count)

    result = GateResult(
        table=table,
        accepted=accepted,
        quarantined=quarantined,
        counts=counts,
        failure_rate=failure_rate,
        report_dir=out_dir,
        errors=errors,
        data_docs=runner.data_docs_index,
    )
    result.summary_path = write_summary(
        out_dir,
        gate_summary(
            result,
            len(frame),
            list(frame.columns),
            day,
            now,
            config,
            previous_count,
            ads is not None,
            outcomes,
            started,
        ),  # fmt: skip
    )
    log.info(
        "%s %s: %d rows, %d accepted, %d quarantined (%.2f%%) in %.1fs",
        table, day, len(frame), len(accepted), len(quarantined), 100 * failure_rate, time.perf_counter() - started,
    )  # fmt: skip
    if errors:
        raise ValidationGateError(
            f"{table} partition {day} failed the validation gate: {'; '.join(errors)} (report: {out_dir})",
            result,
        )
    return result


def _typed_frame(
    frame: pd.DataFrame, schema: pa.Schema, checks: list[parsing.ParseCheck], reasons: _RowReasons
) -> pd.DataFrame:
    """The frame in wide contract types; rows whose text did not parse are null there and carry a type reason."""
    unparseable = {c.column: reasons.rows_of(regex_reason(c)) for c in checks}
    typed = parsing.coerce(frame, schema, unparseable)
    for check in checks:
        reasons.assign(regex_reason(check), parsing.lost_in_cast(frame[check.column], typed[check.column]))
    return typed


def gate_summary(
    result,
    rows: int,
    columns: list[str],
    day: dt.date,
    now: dt.datetime,
    config: GateConfig,
    previous_count: int | None,
    with_ads: bool,
    outcomes: list[Outcome],
    started: float,
) -> dict[str, Any]:
    return {
        "table": result.table,
        "day": day,
        "now": now,
        "passed": not result.errors,
        "errors": result.errors,
        "rows": rows,
        "accepted": result.accepted_rows,
        "quarantined": result.quarantined_rows,
        "failure_rate": result.failure_rate,
        "counts": result.counts,
        "config": {
            "max_failure_rate": config.max_failure_rate,
            "min_volume_ratio": config.min_volume_ratio,
            "min_volume_baseline": config.min_volume_baseline,
            "clock_skew_s": config.clock_skew.total_seconds(),
        },
        "previous_count": previous_count,
        "extra_columns": [c for c in columns if c not in SCHEMAS[result.table].names],
        "referential_integrity": result.table != "events" or with_ads,
        "expectations": [describe(o) for o in outcomes],
        "data_docs": result.data_docs,
        "seconds": round(time.perf_counter() - started, 3),
    }


class _RowReasons:
    """The first failing expectation of every row, as small integer codes (-1: no failure yet)."""

    def __init__(self, n: int) -> None:
        self.codes = np.full(n, -1, dtype=np.int32)
        self.names: list[str] = []

    def add(self, outcome: Outcome) -> None:
        rows = failing_rows(outcome)
        if rows is not None:
            self.assign(outcome.reason, rows)

    def assign(self, reason: str, rows: np.ndarray) -> None:
        if reason not in self.names:
            self.names.append(reason)
        code = self.names.index(reason)
        fresh = rows[self.codes[rows] < 0]
        self.codes[fresh] = code

    def rows_of(self, reason: str) -> np.ndarray:
        if reason not in self.names:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self.codes == self.names.index(reason))

    def clean_rows(self) -> np.ndarray:
        return np.flatnonzero(self.codes < 0)

    def failed_rows(self) -> np.ndarray:
        return np.flatnonzero(self.codes >= 0)

    def labels(self, rows: np.ndarray) -> np.ndarray:
        return (
            np.asarray(self.names, dtype=object)[self.codes[rows]] if len(rows) else np.empty(0, dtype=object)
        )

    def counts(self) -> dict[str, int]:
        tally = np.bincount(self.codes[self.codes >= 0], minlength=len(self.names))
        return {name: int(k) for name, k in zip(self.names, tally, strict=True) if k}


def failing_rows(outcome: Outcome) -> np.ndarray | None:
    """The rows a failed row-level expectation names (None: it passed or judges the table, not rows)."""
    if not outcome.row_level or outcome.success:
        return None
    if outcome.expectation_type != UNIQUE and len(outcome.rows) != outcome.unexpected_count:
        raise RuntimeError(
            f"{outcome.reason}: GX counted {outcome.unexpected_count} failing rows "
            f"but listed {len(outcome.rows)}; refusing to guess which rows failed"
        )
    return outcome.rows


def regex_reason(check: parsing.ParseCheck) -> str:
    return suites.reason_name("expect_column_values_to_match_regex", check.column, check.type_name)


def _later_duplicates(outcome: Outcome, typed: pd.DataFrame) -> Outcome:
    values = typed[outcome.kwargs["column"]].to_numpy()[outcome.rows]
    return later_duplicates(outcome, values)


def later_duplicates(outcome: Outcome, values: np.ndarray) -> Outcome:
    """GX flags every row of a duplicate group (``values``: theirs, in ``outcome.rows`` order); the first
    occurrence stays (it may be the only valid copy)."""
    order = np.argsort(outcome.rows, kind="stable")
    rows = outcome.rows[order]
    later = pd.Series(np.asarray(values, dtype=object)[order]).duplicated(keep="first").to_numpy()
    kept = rows[later]
    return Outcome(
        **{**outcome.__dict__, "rows": kept, "unexpected_count": len(kept), "success": not len(kept)}
    )


@contextmanager
def ads_reference_handle(table: str, ads: pd.DataFrame | None) -> Iterator[str | None]:
    """The handle of the ads table's ids for the referential-integrity check (None: no check)."""
    if table != "events":
        yield None
        return
    if ads is None:
        log.warning("events validated without the ads table: referential integrity of ad_id is not checked")
        yield None
        return
    if "ad_id" not in ads.columns:
        raise ValueError(f"the ads table has no ad_id column (columns: {list(ads.columns)})")
    ids = pd.to_numeric(ads["ad_id"], errors="coerce").dropna().astype(np.int64)
    with registered_reference("ads.ad_id", ids.to_numpy()) as handle:
        yield handle


def _quarantine_frame(frame: pd.DataFrame, reasons: _RowReasons) -> pd.DataFrame:
    """The failing rows as they arrived (mixed-type columns as text, so the quarantine writes to parquet)."""
    rows = reasons.failed_rows()
    out = frame.iloc[rows].copy()
    for column in out.columns:
        if out[column].dtype == object and not _is_list_column(out[column]):
            out[column] = out[column].astype("string")
    out["reason"] = reasons.labels(rows)
    return out


def _is_list_column(values: pd.Series) -> bool:
    kind = pd.api.types.infer_dtype(values, skipna=True)
    return kind == "mixed" and values.dropna().map(lambda v: isinstance(v, list | np.ndarray)).all()


def gate_errors(
    table: str,
    rows: int,
    failure_rate: float,
    config: GateConfig,
    missing: list[Outcome],
    volume: list[Outcome],
    previous_count: int | None,
) -> list[str]:
    errors = []
    if missing:
        names = [o.kwargs["column"] for o in missing]
        errors.append(f"missing column(s) {names} (expected {SCHEMAS[table].names})")
    if failure_rate > config.max_failure_rate:
        errors.append(
            f"failure rate {failure_rate:.2%} exceeds max_failure_rate {config.max_failure_rate:.2%}"
        )
    for outcome in volume:
        if not outcome.success:
            errors.append(
                f"volume dropped: {rows} rows < {outcome.kwargs['min_value']} "
                f"(min_volume_ratio {config.min_volume_ratio} x previous partition's {previous_count}) "
                f"[{outcome.reason}]; if such quiet days are real for this source, lower "
                f"gate.min_volume_ratio (0 turns the rule off) or set gate.min_volume_baseline"
            )
    return errors


def utc_now(now: dt.datetime | None) -> dt.datetime:
    if now is None:
        return dt.datetime.now(dt.UTC)
    if now.tzinfo is None:
        raise ValueError(f"now must be timezone-aware (UTC), got naive {now!r}")
    return now.astimezone(dt.UTC)
