"""The great-expectations suites of the raw contract: one schema suite and one contract suite per table.

Every expectation carries ``meta["reason"]``: the name a quarantined row gets when it fails that expectation,
``<expectation type>(<column>)`` plus a ``[tag]`` where one column has two checks of the same type (e.g.
``expect_column_values_to_be_between(ts)[not_future]``). A row failing several expectations gets the reason of
the first one in suite order, so the order below is the priority: parse, null, vocabulary, range, time, labels,
references, duplicates.

- schema suite (runs on the raw frame): every contract column exists; text that must parse as the column's type
  matches its pattern (only for columns not already stored in a fitting dtype); the partition's volume against
  the previous accepted partition.
- contract suite (runs on the coerced frame): the row-level rules of ``features.schema``.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence

import great_expectations as gx
import pyarrow as pa
from great_expectations.expectations import Expectation
from great_expectations.expectations.row_conditions import Column

from features.schema import ACTIONS, EVENTS_SCHEMA, GENDERS, SCHEMAS, SURFACES
from features.validation.parsing import ParseCheck, type_label
from features.validation.reference import ExpectColumnValuesToBeInReference

E = gx.expectations
INT32_MAX = 2**31 - 1

# The earliest timestamp the gate accepts (``GateConfig.min_ts``): older ones are broken clocks.
EARLIEST = dt.datetime(1990, 1, 1, tzinfo=dt.UTC)


def reason_name(expectation_type: str, column: str | None = None, tag: str | None = None) -> str:
    name = f"{expectation_type}({column or ''})"
    return f"{name}[{tag}]" if tag else name


def _with_reason(expectation: Expectation, column: str | None = None, tag: str | None = None) -> Expectation:
    expectation.meta = {"reason": reason_name(expectation.expectation_type, column, tag)}
    return expectation


def schema_suite(
    table: str, checks: Sequence[ParseCheck], *, min_rows: int | None = None
) -> list[Expectation]:
    schema = SCHEMAS[table]
    out = [_with_reason(E.ExpectColumnToExist(column=name), name) for name in schema.names]
    for check in checks:
        regex = E.ExpectColumnValuesToMatchRegex(column=check.column, regex=check.regex)
        out.append(_with_reason(regex, check.column, check.type_name))
    if min_rows is not None:
        out.append(_with_reason(E.ExpectTableRowCountToBeBetween(min_value=min_rows), tag="volume"))
    return out


def min_rows_for(
    previous_count: int | None, min_volume_ratio: float, min_volume_baseline: int = 0
) -> int | None:
    """The fewest rows a partition may have, given the previous accepted partition's count (None: no check).

    No check without a previous partition, with a ratio of 0, or when the previous partition is smaller than
    ``min_volume_baseline`` (too few rows for a drop to mean anything)."""
    if previous_count is None or min_volume_ratio == 0 or previous_count < min_volume_baseline:
        return None
    return math.ceil(previous_count * min_volume_ratio)


def contract_suite(
    table: str,
    *,
    day: dt.date,
    now: dt.datetime,
    clock_skew: dt.timedelta,
    ads_reference: str | None = None,
    earliest: dt.datetime = EARLIEST,
) -> list[Expectation]:
    """Row-level rules of one table; ``ads_reference`` (events only: the handle of the registered ad ids, see
    ``features.validation.reference``) adds the referential-integrity check."""
    schema = SCHEMAS[table]
    latest = now + clock_skew
    out = [_with_reason(E.ExpectColumnValuesToNotBeNull(column=name), name) for name in schema.names]
    if table == "events":
        out += [*_events_rules(day, latest, ads_reference), _not_before("ts", earliest)]
    elif table == "users":
        out += [
            _in_set("gender", GENDERS),
            *_non_negative("user_id"),
            _between("age", 13, 100),
            _between("country", 0, INT32_MAX),
            _not_future("signup_ts", latest),
            _not_before("signup_ts", earliest),
            _unique("user_id"),
        ]
    elif table == "ads":
        out += [
            *_non_negative("ad_id", "advertiser_id"),
            _between("category_id", 0, INT32_MAX),
            _between("quality", 0.0, 1.0),
            _not_future("created_ts", latest),
            _not_before("created_ts", earliest),
            _unique("ad_id"),
        ]
    return out


def _events_rules(day: dt.date, latest: dt.datetime, ads_reference: str | None) -> list[Expectation]:
    start = dt.datetime.combine(day, dt.time(), tzinfo=dt.UTC)
    not_impression = Column("action") != "impression"
    rules = [
        _in_set("action", ACTIONS),
        _in_set("surface", SURFACES),
        *_non_negative("event_id", "user_id", "ad_id"),
        _in_set("click", (0, 1)),
        _in_set("conversion", (0, 1)),
        _not_future("ts", latest),
        _with_reason(
            E.ExpectColumnValuesToBeBetween(
                column="ts", min_value=start, max_value=start + dt.timedelta(days=1), strict_max=True
            ),
            "ts",
            "partition_window",
        ),
        # Labels live on impressions only; a conversion implies its click.
        _with_reason(
            E.ExpectColumnValuesToBeInSet(column="click", value_set=[0], row_condition=not_impression),
            "click",
            "non_impression",
        ),
        _with_reason(
            E.ExpectColumnValuesToBeInSet(column="conversion", value_set=[0], row_condition=not_impression),
            "conversion",
            "non_impression",
        ),
        _with_reason(
            E.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A="click",
                column_B="conversion",
                or_equal=True,
                ignore_row_if="either_value_is_missing",
            ),
            "click,conversion",
        ),
    ]
    if ads_reference is not None:
        known = ExpectColumnValuesToBeInReference(column="ad_id", reference=ads_reference)
        rules.append(_with_reason(known, "ad_id", "ads"))
    rules.append(_unique("event_id"))
    return rules


def _in_set(column: str, values: Sequence) -> Expectation:
    return _with_reason(E.ExpectColumnValuesToBeInSet(column=column, value_set=list(values)), column)


def _between(column: str, low: float, high: float) -> Expectation:
    return _with_reason(E.ExpectColumnValuesToBeBetween(column=column, min_value=low, max_value=high), column)


def _non_negative(*columns: str) -> list[Expectation]:
    return [_with_reason(E.ExpectColumnValuesToBeBetween(column=c, min_value=0), c) for c in columns]


def _not_future(column: str, latest: dt.datetime) -> Expectation:
    return _with_reason(
        E.ExpectColumnValuesToBeBetween(column=column, max_value=latest), column, "not_future"
    )


def _not_before(column: str, earliest: dt.datetime) -> Expectation:
    """Timestamps before ``earliest`` (negative epochs, 1970 placeholders) are broken clocks, not history."""
    return _with_reason(
        E.ExpectColumnValuesToBeBetween(column=column, min_value=earliest), column, "not_before_min_ts"
    )


def _unique(column: str) -> Expectation:
    # GX flags every member of a duplicate group; the gate keeps the first occurrence of each id.
    return _with_reason(E.ExpectColumnValuesToBeUnique(column=column), column)


_PARSED_EVENT_COLUMNS = [f for f in EVENTS_SCHEMA if not pa.types.is_string(f.type)]

# Which quarantine reasons catch each injected defect class of the events table (the tests' ground truth).
EVENT_DEFECT_REASONS: dict[str, frozenset[str]] = {
    "null_field": frozenset(
        reason_name("expect_column_values_to_not_be_null", n) for n in EVENTS_SCHEMA.names
    ),
    "bad_type": frozenset(
        reason_name("expect_column_values_to_match_regex", f.name, type_label(f.type))
        for f in _PARSED_EVENT_COLUMNS
    ),
    "out_of_range": frozenset(
        reason_name("expect_column_values_to_be_between", n) for n in ("event_id", "user_id", "ad_id")
    ),
    "bad_enum": frozenset(reason_name("expect_column_values_to_be_in_set", n) for n in ("action", "surface")),
    "future_ts": frozenset({reason_name("expect_column_values_to_be_between", "ts", "not_future")}),
    "outside_window": frozenset(
        {reason_name("expect_column_values_to_be_between", "ts", "partition_window")}
    ),
    "duplicate_event_id": frozenset({reason_name("expect_column_values_to_be_unique", "event_id")}),
    "label_action_mismatch": frozenset(
        {
            reason_name("expect_column_values_to_be_in_set", "click", "non_impression"),
            reason_name("expect_column_values_to_be_in_set", "conversion", "non_impression"),
            reason_name("expect_column_pair_values_a_to_be_greater_than_b", "click,conversion"),
        }
    ),
    "unknown_ad": frozenset({reason_name("expect_column_values_to_be_in_reference", "ad_id", "ads")}),
    "volume_drop": frozenset({reason_name("expect_table_row_count_to_be_between", None, "volume")}),
}
