"""Raw columns -> the contract's types, vectorized, in two steps around great-expectations.

1. ``parse_checks`` names the columns whose raw dtype is not already the contract's (text, floats holding ints,
   mixed objects) and the pattern their values must match to parse; the gate turns each into a GX
   ``expect_column_values_to_match_regex`` so GX decides which rows do not parse.
2. ``coerce`` nulls the rows GX flagged and casts every column with one vectorized call (arrow casts for text,
   so int64 ids never round-trip through float64). The result is the frame the contract suite runs on: ints as
   int64 (float64 where nulls remain and that is exact, else ``Int64``), floats as float64, strings, UTC
   timestamps and arrow-shaped lists.

``to_contract`` narrows accepted rows to the exact arrow types of the schema (int16 age, float32 quality, ...).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

# Patterns for text that must parse as the column's type (non-capturing groups: GX runs str.contains).
# Ids get at most 18 digits so they fit int64.
INT_TEXT = r"^\s*-?\d{1,18}\s*$"
INT_AS_FLOAT_TEXT = r"^-?\d{1,18}(?:\.0*)?$"  # ints a float column holds because nulls forced float64
FLOAT_TEXT = r"^\s*[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?\s*$"
TIMESTAMP_TEXT = (
    r"^\s*\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d{1,9})?)?)?\s*(?:Z|[+-]\d{2}:?\d{2})?\s*$"
)
INT_LIST_TEXT = r"^\[[\d\s,+-]*\]$"


@dataclass(frozen=True)
class ParseCheck:
    """Values of ``column`` (as text) must match ``regex`` to parse as ``type_name``."""

    column: str
    regex: str
    type_name: str


def parse_checks(raw: pd.DataFrame, schema: pa.Schema) -> list[ParseCheck]:
    """The text checks the raw frame needs: none for columns already stored in a fitting dtype."""
    checks = []
    for field in schema:
        if field.name in raw.columns:
            regex = _pattern_needed(raw[field.name], field.type)
            if regex is not None:
                checks.append(ParseCheck(field.name, regex, type_label(field.type)))
    return checks


def type_label(type_: pa.DataType) -> str:
    return "list<int32>" if pa.types.is_list(type_) else str(type_).split("[")[0]


def _pattern_needed(values: pd.Series, type_: pa.DataType) -> str | None:
    dtype = values.dtype
    if pd.api.types.is_integer_dtype(dtype) or pd.api.types.is_bool_dtype(dtype):
        kind = "int"
    elif pd.api.types.is_float_dtype(dtype):
        kind = "float"
    elif pd.api.types.is_numeric_dtype(dtype):
        kind = "number"
    elif pd.api.types.is_datetime64_any_dtype(dtype):
        kind = "timestamp"
    elif pa.types.is_list(type_) and _as_int_lists(values) is not None:
        kind = "int_list"
    else:
        kind = "text"
    return pattern_for(kind, type_)


def pattern_for(kind: str, type_: pa.DataType) -> str | None:
    """The pattern a raw column stored as ``kind`` (int, float, number, timestamp, int_list, text) must match to
    parse as ``type_``; None when the stored type already fits. Both engines classify their dtypes into these."""
    if pa.types.is_integer(type_):
        if kind == "int":
            return None
        return INT_AS_FLOAT_TEXT if kind == "float" else INT_TEXT
    if pa.types.is_floating(type_):
        return None if kind in ("int", "float", "number") else FLOAT_TEXT
    if pa.types.is_timestamp(type_):
        return None if kind == "timestamp" else TIMESTAMP_TEXT
    if pa.types.is_list(type_):
        return None if kind == "int_list" else INT_LIST_TEXT
    return None  # strings: any value has a text form; the vocabulary checks judge it


def coerce(raw: pd.DataFrame, schema: pa.Schema, unparseable: Mapping[str, np.ndarray]) -> pd.DataFrame:
    """Every schema column in its wide type; rows listed in ``unparseable[column]`` become null there."""
    out = {}
    for field in schema:
        values = raw[field.name]
        bad = unparseable.get(field.name)
        if bad is not None and len(bad):
            values = values.astype(object) if not pd.api.types.is_float_dtype(values.dtype) else values.copy()
            values.iloc[bad] = None
        try:
            out[field.name] = _cast(values, field.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, TypeError, OverflowError) as err:
            raise ValueError(
                f"column {field.name!r} passed its parse check but does not cast to {field.type}: {err}"
            ) from err
    return pd.DataFrame(out, index=raw.index)


def _cast(values: pd.Series, type_: pa.DataType) -> pd.Series:
    dtype = values.dtype
    if pa.types.is_integer(type_):
        if pd.api.types.is_bool_dtype(dtype):
            return _int_or_nullable(values.astype("Int64"))
        if pd.api.types.is_integer_dtype(dtype):
            return _int_or_nullable(values)
        if pd.api.types.is_float_dtype(dtype):
            return _int_or_nullable(values.astype("Int64"))
        ints = pc.cast(_trimmed_text(values), pa.int64())
        return _int_or_nullable(pd.Series(ints.to_pandas(types_mapper=_NULLABLE_INT.get), index=values.index))
    if pa.types.is_floating(type_):
        if pd.api.types.is_numeric_dtype(dtype):
            return values.astype(np.float64)
        floats = pd.to_numeric(values.astype("string").str.strip(), errors="coerce")
        return pd.Series(floats.to_numpy(dtype=np.float64, na_value=np.nan), index=values.index)
    if pa.types.is_timestamp(type_):
        if pd.api.types.is_datetime64_any_dtype(dtype):
            # Naive timestamps are read as UTC (the contract's zone); aware ones are converted to it.
            return values.dt.tz_localize("UTC") if values.dt.tz is None else values.dt.tz_convert("UTC")
        # The pattern cannot see calendar errors (Feb 30): those become NaT here, and ``lost_in_cast`` reports them.
        return pd.to_datetime(values.astype("string"), utc=True, format="ISO8601", errors="coerce")
    if pa.types.is_list(type_):
        lists = _as_int_lists(values)
        if (
            lists is None
        ):  # lists written as text ("[1, 2]"): small snapshot tables only, so per-value parsing
            lists = _as_int_lists(values.map(_int_list_from_text, na_action="ignore"))
        if lists is None:
            raise ValueError("values are not lists of integers")
        return pd.Series(lists.to_pandas(), index=values.index)
    # strings: keep nulls, give everything else its text form
    if pd.api.types.infer_dtype(values, skipna=True) in ("string", "empty"):
        return values.astype(object)
    return values.astype(object).where(values.isna(), values.astype(str))


_NULLABLE_INT = {pa.int64(): pd.Int64Dtype()}


FLOAT_EXACT_INT = 2**53  # float64 holds every integer up to here exactly


def _int_or_nullable(values: pd.Series) -> pd.Series:
    """int64 without nulls; with nulls float64 when that is exact (GX vectorizes its range checks only on numpy
    int64/float64 and loops in Python over ``Int64``), else ``Int64``."""
    if not values.isna().any():
        return values.astype(np.int64)
    if values.abs().max() <= FLOAT_EXACT_INT:
        return values.astype(np.float64)
    return values.astype("Int64")


def _trimmed_text(values: pd.Series) -> pa.Array:
    text = pa.array(values.astype("string"), type=pa.string(), from_pandas=True)
    return pc.utf8_trim_whitespace(text)


def _int_list_from_text(value: object) -> object:
    return [int(x) for x in re.findall(r"[-+]?\d+", value)] if isinstance(value, str) else value


def _as_int_lists(values: pd.Series) -> pa.Array | None:
    try:
        return pa.array(values, type=pa.list_(pa.int32()), from_pandas=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
        return None


def lost_in_cast(raw: pd.Series, typed: pd.Series) -> np.ndarray:
    """Rows whose value matched its parse pattern yet did not survive the cast (e.g. 2024-02-30, 1e999)."""
    return np.flatnonzero(raw.notna().to_numpy() & typed.isna().to_numpy())


def to_contract(typed: pd.DataFrame, schema: pa.Schema) -> pd.DataFrame:
    """Rows that passed every check, in the exact arrow types of ``schema`` (narrowing casts checked by arrow)."""
    table = pa.Table.from_pandas(typed[schema.names], schema=schema, preserve_index=False)
    return table.to_pandas(ignore_metadata=True)  # the arrow types, not the pandas dtypes they came from


def empty_contract(schema: pa.Schema) -> pd.DataFrame:
    return schema.empty_table().to_pandas()
