"""Row checks of an interaction log before it is converted (``features.sources.interactions``).

A row with an empty id, a timestamp that does not parse or lies before ``min_ts``, or a label / conversion /
rating / order value that does not parse is quarantined with its 1-based row number and a reason (as the
ingest gate quarantines bad raw rows), and the good rows are imported. Problems of the whole file stop the
import instead: a share of bad rows above ``max_bad_fraction`` (a wrong setting rather than bad rows), and
dates whose day/month order is ambiguous (``01/03/2026``) without an explicit ``ts_format``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from features.sources.interaction_format import InteractionFormat

TRUE_LABELS, FALSE_LABELS = ("1", "true", "yes", "y", "t"), ("0", "false", "no", "n", "f")
# 01/03/2026, 1.3.26, 01-03-2026: day-first or month-first cannot be told from the text
AMBIGUOUS_DATE = re.compile(r"^\s*\d{1,2}[/.\-]\d{1,2}[/.\-]\d{2,4}\b")


class RowFormatError(ValueError):
    """The rows as a whole do not fit the declared format (ambiguous dates, too many bad rows)."""


def rows_text(index: pd.Index, limit: int = 5) -> str:
    """'row 3' / 'rows 3, 9, 12, ...' (1-based data rows: line = row + 1 in a file with a header)."""
    numbers = [str(int(i) + 1) for i in index[:limit]]
    more = ", ..." if len(index) > limit else ""
    return f"row{'s' if len(index) > 1 else ''} {', '.join(numbers)}{more}"


def flag_values(values: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(true, parsed) for a 0/1, true/false, yes/no column."""
    text = values.astype(str).str.strip().str.lower().str.replace(r"\.0$", "", regex=True)
    truthy, falsy = text.isin(TRUE_LABELS).to_numpy(), text.isin(FALSE_LABELS).to_numpy()
    return truthy, truthy | falsy


def parse_timestamps(raw: pd.Series, fmt: InteractionFormat) -> pd.Series:
    """UTC timestamps (NaT where a value does not parse). Numbers are epochs in ``ts_unit``; text is read with
    ``ts_format`` when given, else as ISO-like text, refusing day/month-ambiguous dates."""
    if pd.api.types.is_numeric_dtype(raw) and not pd.api.types.is_bool_dtype(raw):
        numbers = pd.to_numeric(raw, errors="coerce")
        too_big = numbers.abs() > 1e19  # beyond int64 nanoseconds in any unit: not a timestamp
        return pd.to_datetime(numbers.mask(too_big), unit=fmt.ts_unit, utc=True, errors="coerce")
    if fmt.ts_format:
        return pd.to_datetime(raw, format=fmt.ts_format, utc=True, errors="coerce")
    ambiguous = raw.astype("string").str.match(AMBIGUOUS_DATE).fillna(False).to_numpy(bool)
    if ambiguous.any():
        first = raw[ambiguous].iloc[0]
        raise RowFormatError(
            f"{fmt.ts_col}: {first!r} ({rows_text(raw.index[ambiguous])}) could be day/month or month/day: "
            "give --ts-format, e.g. --ts-format '%d/%m/%Y' or '%m/%d/%Y %H:%M'"
        )
    return pd.to_datetime(raw, utc=True, errors="coerce", format="mixed")


def min_timestamp(fmt: InteractionFormat) -> pd.Timestamp:
    try:
        stamp = pd.Timestamp(str(fmt.min_ts))
    except ValueError as err:
        raise RowFormatError(f"min_ts {fmt.min_ts!r} is not a date like 1990-01-01") from err
    return stamp.tz_localize("UTC") if stamp.tzinfo is None else stamp.tz_convert("UTC")


def row_reasons(frame: pd.DataFrame, fmt: InteractionFormat) -> pd.Series:
    """Per row, the reason it is bad ("" = good); the first failing check names it."""
    reasons = pd.Series("", index=frame.index, dtype=object)

    def mark(bad: np.ndarray, reason: str) -> None:
        reasons[(reasons == "").to_numpy() & bad] = reason

    for column, kind in ((fmt.user_col, "user"), (fmt.item_col, "item")):
        values = frame[column]
        mark(
            (values.isna() | (values.astype(str).str.strip() == "")).to_numpy(), f"{column}: empty {kind} id"
        )
        if pd.api.types.is_numeric_dtype(values):
            mark((values < 0).fillna(False).to_numpy(bool), f"{column}: negative {kind} id")
    if fmt.ts_col:
        parsed = parse_timestamps(frame[fmt.ts_col], fmt)
        mark(parsed.isna().to_numpy(), f"{fmt.ts_col}: not a timestamp")
        mark(
            (parsed < min_timestamp(fmt)).fillna(False).to_numpy(bool),
            f"{fmt.ts_col}: before min_ts {fmt.min_ts}",
        )
    if fmt.order_col:
        mark(
            pd.to_numeric(frame[fmt.order_col], errors="coerce").isna().to_numpy(),
            f"{fmt.order_col}: not a number",
        )
    for column, what in ((fmt.label_col, "label"), (fmt.conversion_col, "flag")):
        if column:
            mark(~flag_values(frame[column])[1], f"{column}: not a 0/1 {what}")
    if fmt.rating_col:
        mark(
            pd.to_numeric(frame[fmt.rating_col], errors="coerce").isna().to_numpy(),
            f"{fmt.rating_col}: not a number",
        )
    return reasons


def quarantine_rows(frame: pd.DataFrame, fmt: InteractionFormat) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(good rows, quarantined rows with ``row`` and ``reason``); raises when too many rows are bad."""
    if not 0.0 <= fmt.max_bad_fraction < 1.0:
        raise RowFormatError(f"max_bad_fraction must be in [0, 1), got {fmt.max_bad_fraction}")
    reasons = row_reasons(frame, fmt)
    bad = (reasons != "").to_numpy()
    quarantined = frame[bad].copy()
    quarantined.insert(0, "reason", reasons[bad].to_numpy())
    quarantined.insert(0, "row", (frame.index[bad] + 1).to_numpy(np.int64))
    if bad.any() and bad.mean() > fmt.max_bad_fraction:
        groups = [
            f"{reason} in {len(rows)} row(s) ({rows_text(rows)}, e.g. {_sample(frame, rows, reason)})"
            for reason, rows in reasons[bad].groupby(reasons[bad]).groups.items()
        ]
        raise RowFormatError(
            f"{int(bad.sum())} of {len(frame)} rows are bad, more than max_bad_fraction {fmt.max_bad_fraction} "
            f"(check the column settings): {'; '.join(groups)}"
        )
    return frame[~bad], quarantined.reset_index(drop=True)


def _sample(frame: pd.DataFrame, rows: pd.Index, reason: str) -> str:
    column = reason.split(":", 1)[0]
    return repr(list(pd.unique(frame.loc[rows[:3], column].astype(str)))) if column in frame else "?"
