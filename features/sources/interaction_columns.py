"""The interaction rows as columns: ids, timestamps, labels, and the events they become.

Each function reads a column of the (already row-checked) log per ``InteractionFormat`` and refuses values that
do not fit with an ``InteractionFormatError`` that names the rows and shows examples.
"""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pyarrow as pa

from features.schema import ACTION_ID, ACTIONS, SCHEMAS, SURFACES, TS
from features.sources import writer
from features.sources.interaction_format import InteractionFormat, InteractionFormatError
from features.sources.interaction_rows import RowFormatError, flag_values, parse_timestamps, rows_text
from features.vocabulary import text_id


def examples(values: pd.Series, bad: np.ndarray) -> str:
    sample = pd.unique(values[bad].astype(str))[:5]
    return f"{int(bad.sum())} row(s) ({rows_text(values.index[bad])}), e.g. {list(sample)}"


def entity_ids(values: pd.Series, column: str, kind: str, id_maps: dict[str, pd.DataFrame]) -> np.ndarray:
    """Integer ids >= 0 as they are; anything else -> a stable 63-bit hash of the text (recorded in id_maps)."""
    missing = values.isna().to_numpy()
    if missing.any():
        raise InteractionFormatError(f"{column}: {int(missing.sum())} empty {kind} id(s)")
    if pd.api.types.is_float_dtype(values) and (values == np.floor(values)).all():
        values = values.astype(np.int64)  # integers read as floats (a column that had an empty cell)
    if pd.api.types.is_integer_dtype(values):
        ids = values.to_numpy(dtype=np.int64)
        if (ids < 0).any():
            raise InteractionFormatError(f"{column}: negative {kind} id(s): {examples(values, ids < 0)}")
        return ids
    text = values.astype(str)
    unique = pd.unique(text)
    hashed = np.array([text_id(v) for v in unique], dtype=np.int64)
    if len(np.unique(hashed)) != len(unique):
        raise InteractionFormatError(f"{column}: two {kind} ids hash to the same int64; rename one of them")
    id_maps[kind] = pd.DataFrame({"raw": unique, f"{kind}_id": hashed})
    return hashed[pd.Index(unique).get_indexer(text)]


def timestamps_us(frame: pd.DataFrame, fmt: InteractionFormat, user_id: np.ndarray) -> np.ndarray:
    """Microseconds since the epoch (UTC) for every row."""
    if fmt.order_col:
        order = pd.to_numeric(frame[fmt.order_col], errors="coerce")
        bad = order.isna().to_numpy()
        if bad.any():
            raise InteractionFormatError(
                f"{fmt.order_col}: not a number in {examples(frame[fmt.order_col], bad)}"
            )
        # Rank within the user (ties keep input order): one synthetic minute per step from base_date.
        rank = pd.DataFrame({"u": user_id, "o": order.to_numpy()}).groupby("u").o.rank(method="first") - 1
        base = dt.datetime.combine(dt.date.fromisoformat(str(fmt.base_date)), dt.time(), tzinfo=dt.UTC)
        return int(base.timestamp()) * 1_000_000 + rank.to_numpy(dtype=np.int64) * 60_000_000
    raw = frame[fmt.ts_col]
    try:
        parsed = parse_timestamps(raw, fmt)
    except RowFormatError as err:
        raise InteractionFormatError(str(err)) from None
    except (ValueError, TypeError, OverflowError) as err:
        raise InteractionFormatError(f"{fmt.ts_col}: not timestamps ({err})") from err
    bad = parsed.isna().to_numpy()
    if bad.any():
        raise InteractionFormatError(f"{fmt.ts_col}: not a timestamp in {examples(raw, bad)}")
    return parsed.dt.floor("us").to_numpy(dtype="datetime64[us]").astype(np.int64)


def labels(frame: pd.DataFrame, fmt: InteractionFormat) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(label, strong) as bool arrays; (None, None) when the log carries neither label nor rating."""
    rating = None
    if fmt.rating_col:
        rating = pd.to_numeric(frame[fmt.rating_col], errors="coerce")
        bad = rating.isna().to_numpy()
        if bad.any():
            raise InteractionFormatError(
                f"{fmt.rating_col}: not a number in {examples(frame[fmt.rating_col], bad)}"
            )
        rating = rating.to_numpy(dtype=np.float64)
    converted = _flags(frame, fmt.conversion_col) if fmt.conversion_col else None
    if fmt.label_col:
        label = _flags(frame, fmt.label_col, "label")
    elif converted is not None:  # a conversion log without clicks: the conversions are the positives
        label = converted.copy()
    elif rating is not None:
        label = rating >= fmt.positive_rating
    elif fmt.positive_only:
        label = np.ones(len(frame), dtype=bool)
    else:
        return None, None
    strong = label & (rating >= fmt.strong_rating) if fmt.strong_rating is not None else np.zeros_like(label)
    if converted is not None:  # a purchase is a positive too, whatever the click column says
        label, strong = label | converted, converted
    return label, strong


def _flags(frame: pd.DataFrame, column: str, what: str = "flag") -> np.ndarray:
    """A 0/1, true/false, yes/no column as bool (anything else is an error naming the rows)."""
    truthy, parsed = flag_values(frame[column])
    bad = ~parsed
    if bad.any():
        raise InteractionFormatError(f"{column}: not a 0/1 {what} in {examples(frame[column], bad)}")
    return truthy


def events_table(fmt, user_id, item_id, ts_us, label, strong) -> pa.Table:
    n = len(user_id)
    if label is None:
        action = np.full(n, ACTION_ID[fmt.unlabeled_action])
        label = strong = np.zeros(n, dtype=bool)
    else:
        action = np.full(n, ACTION_ID["impression"])
    clicked, converted = np.flatnonzero(label), np.flatnonzero(strong)
    if fmt.positive_only:  # the impression carries the label; a click event would repeat it
        clicked = converted = np.zeros(0, dtype=np.int64)
    rows = np.concatenate([np.arange(n), clicked, converted])
    ts = np.concatenate([ts_us, ts_us[clicked] + 1_000_000, ts_us[converted] + 2_000_000])
    actions = np.concatenate(
        [action, np.full(clicked.size, ACTION_ID["click"]), np.full(converted.size, ACTION_ID["conversion"])]
    )
    click = np.concatenate([label, np.zeros(clicked.size + converted.size, bool)]).astype(np.int8)
    conversion = np.concatenate([strong, np.zeros(clicked.size + converted.size, bool)]).astype(np.int8)
    # A follow-up event sorts right after its impression among events of the same time.
    order = np.lexsort((np.arange(rows.size), user_id[rows], ts))
    rows, ts, actions, click, conversion = (
        rows[order],
        ts[order],
        actions[order],
        click[order],
        conversion[order],
    )
    return pa.Table.from_arrays(
        [
            pa.array(np.arange(rows.size, dtype=np.int64)),
            pa.array(user_id[rows]),
            pa.array(item_id[rows]),
            writer.strings(actions, ACTIONS),
            writer.strings(np.full(rows.size, SURFACES.index(fmt.surface)), SURFACES),
            pa.array(ts, TS),
            pa.array(click),
            pa.array(conversion),
        ],
        schema=SCHEMAS["events"],
    )
