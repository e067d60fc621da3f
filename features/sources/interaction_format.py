"""The declared format of an interaction log, reading its file, and the checks of format against columns.

``InteractionFormat`` says which columns hold what (see ``docs/interaction-format.md``); ``read_table`` reads
CSV/TSV/parquet; ``check_format`` refuses settings that contradict each other or name missing columns.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from features.schema import ACTIONS, SURFACES

READERS = {
    ".csv": ",",
    ".tsv": "\t",
    ".tab": "\t",
    ".txt": None,
    ".inter": "\t",
    ".item": "\t",
    ".user": "\t",
}


class InteractionFormatError(ValueError):
    """The input does not fit the declared interaction format (missing or ill-typed column, ...)."""


@dataclass
class InteractionFormat:
    user_col: str = "user_id"
    item_col: str = "item_id"
    ts_col: str | None = None  # unix time (ts_unit) or date-time text (UTC unless it carries an offset)
    ts_unit: str = "s"
    ts_format: str | None = None  # strptime format of text timestamps; required for dates like 01/03/2026
    min_ts: str = (
        "1990-01-01"  # rows before this time (UTC) are quarantined: negative epochs, 1970 placeholders
    )
    order_col: str | None = None  # order within the user, when there are no timestamps
    label_col: str | None = None  # 0/1, true/false, yes/no
    conversion_col: str | None = None  # 0/1 purchase / conversion flag; a conversion is also a positive
    rating_col: str | None = None
    positive_rating: float | None = None  # label = rating >= this (when there is no label column)
    strong_rating: float | None = None  # rating >= this also yields a conversion
    item_attrs_col: str | None = None  # attribute list: text split on attr_sep, or a list column
    attr_sep: str = "|"
    advertiser_col: str | None = (
        None  # item column whose value is the advertiser (integers kept, text mapped)
    )
    age_col: str | None = None
    gender_col: str | None = None
    country_col: str | None = None  # any categorical user attribute (MovieLens: occupation)
    default_age: int = 30  # for users without an age
    surface: str = "feed"
    unlabeled_action: str = "view"  # action of rows that carry neither label nor rating
    # Every row is a positive (a purchase, a review, a play): one impression per row with click = 1 and no
    # follow-up click event (it would only double every history without adding information).
    positive_only: bool = False
    base_date: str = "2026-01-01"  # where synthetic timestamps start (order-only input): one per minute
    delimiter: str | None = None  # CSV delimiter; by default from the file extension
    encoding: str = "utf-8"  # text encoding of CSV/TSV input (e.g. latin-1, cp1252)
    # Bad rows (empty id, unparseable or too old timestamp, bad label) are quarantined with a reason; a larger
    # share than this means a wrong setting rather than bad rows, and stops the import.
    max_bad_fraction: float = 0.1


def read_table(
    source: str | Path | pd.DataFrame, delimiter: str | None = None, encoding: str = "utf-8"
) -> pd.DataFrame:
    """A DataFrame from CSV/TSV/parquet (optionally compressed: .gz, .bz2, .zst, .xz)."""
    if isinstance(source, pd.DataFrame):
        return source
    path = Path(source)
    if not path.exists():
        raise InteractionFormatError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise InteractionFormatError(f"{path}: the file is empty (0 bytes)")
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".gz", ".bz2", ".zst", ".xz", ".zip"):
        suffixes = suffixes[:-1]
    kind = suffixes[-1] if suffixes else ""
    if kind in (".parquet", ".pq"):
        return pd.read_parquet(path)
    if kind not in READERS and delimiter is None:
        raise InteractionFormatError(
            f"{path}: unknown file type {kind or '(none)'}; use .csv, .tsv or .parquet, or give a delimiter"
        )
    sep = delimiter or READERS[kind]
    try:
        return pd.read_csv(
            path, sep=sep, engine="python" if sep is None else "c", keep_default_na=True, encoding=encoding
        )
    except UnicodeDecodeError as err:
        raise InteractionFormatError(
            f"{path}: not {encoding} text (byte 0x{err.object[err.start]:02x} at position {err.start}); "
            "give its encoding, e.g. --encoding latin-1"
        ) from None
    except LookupError:
        raise InteractionFormatError(f"{path}: unknown encoding {encoding!r}") from None
    except pd.errors.EmptyDataError:
        raise InteractionFormatError(f"{path}: no header and no rows (only blank lines)") from None
    except pd.errors.ParserError as err:
        raise InteractionFormatError(f"{path}: not {kind or 'delimited'} text: {err}".strip()) from None


CONVERSION_NAMES = re.compile(r"purchas|conver|bought|order|checkout|sale", re.IGNORECASE)


def unused_conversion_columns(frame: pd.DataFrame, fmt: InteractionFormat) -> list[str]:
    """Warnings for columns that look like conversions while the format reads none (they would import as 0)."""
    if fmt.conversion_col or fmt.strong_rating is not None:
        return []
    used = {fmt.user_col, fmt.item_col, fmt.ts_col, fmt.order_col, fmt.label_col, fmt.rating_col}
    return [
        f"column {c!r} looks like a conversion flag but is not read, so every conversion is 0: "
        f"give --conversion-col {c}"
        for c in frame.columns
        if c not in used and CONVERSION_NAMES.search(str(c))
    ]


def check_format(fmt: InteractionFormat, interactions, items, users) -> None:
    if fmt.ts_col and fmt.order_col:
        raise InteractionFormatError("give either ts_col or order_col, not both")
    if not (fmt.ts_col or fmt.order_col):
        raise InteractionFormatError("give ts_col (timestamps) or order_col (order within the user)")
    if fmt.rating_col and not fmt.label_col and fmt.positive_rating is None:
        raise InteractionFormatError("rating_col needs positive_rating (label = rating >= it) or a label_col")
    if fmt.positive_only and (fmt.label_col or fmt.rating_col):
        raise InteractionFormatError(
            "positive_only logs carry no label_col or rating_col: every row is positive"
        )
    if fmt.strong_rating is not None and not fmt.rating_col:
        raise InteractionFormatError("strong_rating needs rating_col")
    if fmt.conversion_col and (fmt.strong_rating is not None or fmt.positive_only):
        raise InteractionFormatError(
            "conversion_col marks conversions itself: drop strong_rating / positive_only"
        )
    if fmt.surface not in SURFACES:
        raise InteractionFormatError(f"surface {fmt.surface!r} is not one of {list(SURFACES)}")
    if fmt.unlabeled_action not in ACTIONS or fmt.unlabeled_action in ("click", "conversion"):
        raise InteractionFormatError(
            f"unlabeled_action {fmt.unlabeled_action!r} must be one of {list(ACTIONS)} "
            "other than click/conversion"
        )
    if not 13 <= fmt.default_age <= 100:
        raise InteractionFormatError(f"default_age must be in 13..100, got {fmt.default_age}")
    try:
        dt.date.fromisoformat(str(fmt.base_date))
    except ValueError as err:
        raise InteractionFormatError(f"base_date {fmt.base_date!r} is not a date like 2026-01-31") from err

    item_side = [fmt.item_attrs_col, fmt.advertiser_col]
    user_side = [fmt.age_col, fmt.gender_col, fmt.country_col]
    require_columns(
        interactions,
        "interactions",
        [fmt.user_col, fmt.item_col, fmt.ts_col, fmt.order_col, fmt.label_col, fmt.rating_col]
        + [fmt.conversion_col]
        + (item_side if items is None else [])
        + (user_side if users is None else []),
    )
    if items is not None:
        require_columns(items, "items", [fmt.item_col, *item_side])
    if users is not None:
        require_columns(users, "users", [fmt.user_col, *user_side])


def require_columns(frame: pd.DataFrame, name: str, columns: list[str | None]) -> None:
    missing = [c for c in columns if c and c not in frame.columns]
    if missing:
        hint = ""
        if len(frame.columns) == 1:  # one wide column: the file is split on another character
            found = [d for d in (";", "\t", "|", ",", " ") if d in str(frame.columns[0])]
            if found:
                shown = "tab" if found[0] == "\t" else found[0]
                hint = f" (its header looks {shown!r}-delimited: give --delimiter {shown!r})"
        raise InteractionFormatError(
            f"{name}: missing column(s) {missing}; it has {list(frame.columns)}{hint}"
        )
