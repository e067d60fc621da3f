"""The validation gate on Spark DataFrames: ``features.validation.gate`` with GX's Spark datasource.

The same suites (``features.validation.suites``: expectations, order = priority, reason strings), the same
parse patterns (``parsing.pattern_for``), the same first-reason-per-row rule and the same "later duplicates"
rule, so the same raw rows give the same quarantine (rows and reasons) and the same accepted rows. Spark frames
have no positions: ``ROW`` (the row's place in the landed files, ``features.spark.ingest``) names rows for GX
(``unexpected_index_column_names``) and orders the quarantine. Each suite is one GX validation run (GX costs
~2 s per check there, so checks are batched into the two suites, never run one by one).

What reaches the driver: GX's failing-row ids (bounded by ``max_failure_rate``; a worse partition fails) and
the accepted ads' ids for the referential check. Accepted rows stay distributed.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from features.schema import SCHEMAS
from features.validation import parsing, suites
from features.validation.gate import (
    UNIQUE,
    GateConfig,
    ValidationGateError,
    ads_reference_handle,
    failing_rows,
    gate_errors,
    gate_summary,
    later_duplicates,
    regex_reason,
    utc_now,
)
from features.validation.reference import registered_reference
from features.validation.report import GxRunner, write_summary

log = logging.getLogger(__name__)

ROW = "_row"
_INTEGRAL = (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.BooleanType)


@dataclass
class SparkGateResult:
    table: str
    accepted: DataFrame  # wide contract types (long, double, timestamp, string, array<int>), no ROW
    quarantined: DataFrame  # raw columns + "reason" + ROW (the quarantine's order)
    counts: dict[str, int]
    failure_rate: float
    report_dir: Path
    rows: int
    quarantined_rows: int
    errors: list[str] = field(default_factory=list)
    summary_path: Path | None = None
    data_docs: Path | None = None

    @property
    def accepted_rows(self) -> int:
        return self.rows - self.quarantined_rows


def _kind(dtype: T.DataType) -> str:
    """A Spark type as ``parsing.pattern_for``'s storage kind."""
    if isinstance(dtype, _INTEGRAL):
        return "int"
    if isinstance(dtype, T.FloatType | T.DoubleType):
        return "float"
    if isinstance(dtype, T.DecimalType):
        return "number"
    if isinstance(dtype, T.TimestampType | T.TimestampNTZType):
        return "timestamp"
    if isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, _INTEGRAL):
        return "int_list"
    return "text"


def parse_checks(raw: DataFrame, schema: pa.Schema) -> list[parsing.ParseCheck]:
    types = {f.name: f.dataType for f in raw.schema.fields}
    checks = []
    for fld in schema:
        if fld.name in types:
            regex = parsing.pattern_for(_kind(types[fld.name]), fld.type)
            if regex is not None:
                checks.append(parsing.ParseCheck(fld.name, regex, parsing.type_label(fld.type)))
    return checks


def _wide(type_: pa.DataType) -> str:
    if pa.types.is_integer(type_):
        return "long"
    if pa.types.is_floating(type_):
        return "double"
    if pa.types.is_timestamp(type_):
        return "timestamp"
    if pa.types.is_list(type_):
        return "array<int>"
    return "string"


def _typed(column: str, type_: pa.DataType, check: parsing.ParseCheck | None) -> Column:
    """``parsing.coerce`` on Spark: a value that fails its pattern (or then its cast) is null."""
    c, wide = F.col(column), _wide(type_)
    if check is None:
        return c.cast(wide)
    text = F.regexp_replace(c.cast("string"), r"^\s+|\s+$", "")
    parsed = F.from_json(text, wide) if wide == "array<int>" else text.try_cast(wide)
    return F.when(c.cast("string").rlike(check.regex), parsed)


class _Reasons:
    """The first failing expectation per row, kept sparse (failing rows only): rows + reason, in suite order."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.reasons: list[str] = []

    def assign(self, reason: str, rows: np.ndarray) -> None:
        if len(rows):
            self.rows.append(np.asarray(rows, np.int64))
            self.reasons.append(reason)

    def resolved(self) -> tuple[np.ndarray, np.ndarray]:
        """(row ids ascending, their first reason)."""
        if not self.rows:
            return np.zeros(0, np.int64), np.zeros(0, object)
        rows = np.concatenate(self.rows)
        labels = np.repeat(np.asarray(self.reasons, object), [len(r) for r in self.rows])
        unique, first = np.unique(rows, return_index=True)  # first occurrence = earliest in suite order
        return unique, labels[first]


def validate_partition(
    spark: SparkSession,
    table: str,
    raw: DataFrame,
    *,
    rows: int,
    day: dt.date,
    report_dir: Path,
    ads: DataFrame | None = None,
    previous_count: int | None = None,
    now: dt.datetime | None = None,
    config: GateConfig = GateConfig(),
) -> SparkGateResult:
    """``features.validation.validate_partition`` for a Spark frame with a ``ROW`` column of ``rows`` rows."""
    started = time.perf_counter()
    now, schema = utc_now(now), SCHEMAS[table]
    columns = [c for c in raw.columns if c != ROW]
    if len(set(columns)) != len(columns):
        raise ValueError(f"{table}: duplicate column name(s) in {columns}")
    out_dir = Path(report_dir) / table
    runner = GxRunner(out_dir, data_docs=config.data_docs, engine="spark", index_column=ROW)
    reasons = _Reasons()

    min_rows = suites.min_rows_for(previous_count, config.min_volume_ratio, config.min_volume_baseline)
    checks = parse_checks(raw, schema)
    outcomes = runner.run(f"{table}_schema", raw, suites.schema_suite(table, checks, min_rows=min_rows))
    missing = [o for o in outcomes if o.expectation_type == "expect_column_to_exist" and not o.success]
    volume = [o for o in outcomes if o.expectation_type == "expect_table_row_count_to_be_between"]

    if missing:
        failed = raw.select(ROW, F.lit(missing[0].reason).alias("reason"))
        accepted = spark.createDataFrame([], ", ".join(f"{f.name} string" for f in schema))
        counts, quarantined_rows = ({missing[0].reason: rows} if rows else {}), rows
    else:
        for outcome in outcomes:
            _add(reasons, outcome)
        by_column = {c.column: c for c in checks}
        typed = raw.select(
            ROW, *[_typed(f.name, f.type, by_column.get(f.name)).alias(f.name) for f in schema]
        )
        _lost_in_cast(raw, schema, checks, reasons)
        with _ads_reference(table, ads) as ads_reference:
            rules = suites.contract_suite(
                table, day=day, now=now, clock_skew=config.clock_skew, ads_reference=ads_reference,
                earliest=config.earliest,
            )  # fmt: skip
            contract_outcomes = runner.run(table, typed, rules)
        for outcome in contract_outcomes:
            if outcome.expectation_type == UNIQUE and not outcome.success:
                outcome = later_duplicates(outcome, outcome.values)
            _add(reasons, outcome)
            outcomes.append(outcome)
        ids, labels = reasons.resolved()
        failed_ids = spark.createDataFrame(pa.table({ROW: ids, "reason": labels.astype(str)}))
        failed = raw.join(F.broadcast(failed_ids), on=ROW).select(ROW, "reason")
        accepted = typed.join(F.broadcast(failed_ids.select(ROW)), on=ROW, how="left_anti").drop(ROW)
        names, tally = np.unique(labels.astype(str), return_counts=True)
        order = {r: k for k, r in enumerate(dict.fromkeys(reasons.reasons))}
        counts = {
            str(n): int(k) for n, k in sorted(zip(names, tally, strict=True), key=lambda p: order[p[0]])
        }
        quarantined_rows = len(ids)
    quarantined = raw.join(failed, on=ROW)
    failure_rate = quarantined_rows / rows if rows else 0.0
    errors = gate_errors(table, rows, failure_rate, config, missing, volume, previous_count)
    result = SparkGateResult(
        table=table, accepted=accepted, quarantined=quarantined, counts=counts, failure_rate=failure_rate,
        report_dir=out_dir, rows=rows, quarantined_rows=quarantined_rows, errors=errors,
        data_docs=runner.data_docs_index,
    )  # fmt: skip
    result.summary_path = write_summary(
        out_dir,
        gate_summary(
            result, rows, columns, day, now, config, previous_count, ads is not None, outcomes, started
        ),
    )
    log.info(
        "%s %s (spark): %d rows, %d quarantined (%.2f%%) in %.1fs",
        table, day, rows, quarantined_rows, 100 * failure_rate, time.perf_counter() - started,
    )  # fmt: skip
    if errors:
        raise ValidationGateError(
            f"{table} partition {day} failed the validation gate: {'; '.join(errors)} (report: {out_dir})",
            result,
        )
    return result


def _add(reasons: _Reasons, outcome) -> None:
    rows = failing_rows(outcome)
    if rows is not None:
        reasons.assign(outcome.reason, rows)


def _lost_in_cast(
    raw: DataFrame, schema: pa.Schema, checks: list[parsing.ParseCheck], reasons: _Reasons
) -> None:
    """``parsing.lost_in_cast``: values that matched their pattern yet did not cast (2024-02-30, 1e999 ...)."""
    if not checks:
        return
    lost = {
        c.column: F.col(c.column).isNotNull() & _typed(c.column, schema.field(c.column).type, c).isNull()
        for c in checks
    }
    flagged = raw.select(ROW, *[v.alias(k) for k, v in lost.items()])
    any_lost = F.greatest(*[F.col(k) for k in lost]) if len(lost) > 1 else F.col(next(iter(lost)))
    found = flagged.where(any_lost).toArrow()
    for check in checks:
        rows = found.filter(found.column(check.column)).column(ROW).to_numpy()
        reasons.assign(regex_reason(check), rows)


def _ads_reference(table: str, ads: DataFrame | None):
    """The registered ad ids for the referential check (``gate._ads_reference`` with a Spark frame)."""
    if table != "events" or ads is None:
        return ads_reference_handle(table, None)
    ids = ads.select("ad_id").toArrow().column("ad_id").to_numpy()
    return registered_reference("ads.ad_id", ids)
