"""The generic importer: any interaction log -> the raw contract of ``features.schema`` (see
``docs/interaction-format.md``).

Input: one row per (user, item) interaction, as CSV/TSV/parquet or a DataFrame, with a timestamp or an order
within the user, optionally a label or a rating, item attributes and user attributes (inline or in separate
item/user tables). Output: day partitions of events, and per day snapshots of the users and ads known by then.

Mapping: items become ads (advertiser = a chosen item column or 0, categories = the attribute list, the first one
is ``category_id``, quality 0.5); each interaction is an ``impression`` whose click label is the row's label, and
a positive one is followed by a ``click`` event 1 s later (a strong positive, e.g. rating 5, also by a
``conversion`` 2 s later). Rows without label or rating become an organic action (``unlabeled_action``).
Integer ids >= 0 are kept; any other id (strings) becomes a stable int64 (64-bit BLAKE2b of its text, top bit
cleared), so the same id gets the same number in every file and run. Categorical attributes become small ids by
their sorted vocabulary, written to the run folder with the id maps.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from features.schema import ACTION_ID, ACTIONS, GENDERS, SCHEMAS, SURFACES, TS
from features.sources import writer
from features.sources.interaction_rows import (
    RowFormatError,
    flag_values,
    parse_timestamps,
    quarantine_rows,
    rows_text,
)
from features.vocabulary import text_id
from gemflow.config import save_config
from gemflow.workspace import Workspace

NONE_TOKEN = "<none>"  # the category / country of rows that have none
GENDER_SPELLINGS = {
    "male": ("m", "male", "man"),
    "female": ("f", "female", "woman"),
    "unknown": ("", "u", "unknown", "na", "n/a", "none"),
}
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


@dataclass
class RawLog:
    """The converted log, before it is split into day partitions."""

    events: pa.Table  # EVENTS_SCHEMA, sorted by (ts, user, input order)
    users: pa.Table  # USERS_SCHEMA (signup_ts = first interaction)
    ads: pa.Table  # ADS_SCHEMA (created_ts = first interaction)
    stats: dict[str, Any] = field(default_factory=dict)
    vocabularies: dict[str, list[str]] = field(default_factory=dict)
    id_maps: dict[str, pd.DataFrame] = field(default_factory=dict)  # raw id -> int64, where ids were hashed
    quarantined: pd.DataFrame | None = None  # bad input rows: ``row`` (1-based), ``reason``, their columns


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


def import_interactions(
    interactions: str | Path | pd.DataFrame,
    fmt: InteractionFormat,
    ws: Workspace,
    *,
    items: str | Path | pd.DataFrame | None = None,
    users: str | Path | pd.DataFrame | None = None,
    source: str = "interactions",
    progress: bool = True,
) -> dict[str, Any]:
    """Convert and write day partitions into ``ws``; record the format, vocabularies and id maps of the run.
    Bad rows go to the run folder's ``quarantine.parquet`` with their row number and reason."""
    name = "interactions" if isinstance(interactions, pd.DataFrame) else str(interactions)
    try:
        frame = read_table(interactions, fmt.delimiter, fmt.encoding)
        log = to_raw(
            frame,
            fmt,
            items=None if items is None else read_table(items, fmt.delimiter, fmt.encoding),
            users=None if users is None else read_table(users, fmt.delimiter, fmt.encoding),
        )
    except InteractionFormatError as err:
        text = str(err)
        raise InteractionFormatError(text if text.startswith(name) else f"{name}: {text}") from None
    days = write_raw(log, ws, progress=progress)
    summary = {"source": source, **log.stats, "days": len(days), "first_day": days[0], "last_day": days[-1]}
    summary["warnings"] = unused_conversion_columns(frame, fmt)
    if log.stats["quarantined"]:
        summary["warnings"].append(
            f"{log.stats['quarantined']} bad row(s) quarantined (not imported): {log.stats['quarantine_reasons']}"
        )
    run_dir = ws.raw("_runs") / f"{source}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S%fZ}"
    save_config(fmt, run_dir)
    if log.quarantined is not None and len(log.quarantined):
        path = run_dir / "quarantine.parquet"
        log.quarantined.astype({c: "string" for c in log.quarantined.columns if c != "row"}).to_parquet(
            path, index=False
        )
        summary["quarantine"] = str(path)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "vocabularies.json").write_text(json.dumps(log.vocabularies, indent=2))
    for name, mapping in log.id_maps.items():
        mapping.to_parquet(run_dir / f"{name}_ids.parquet", index=False)
    summary["run_dir"] = str(run_dir)
    return summary


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


def write_raw(log: RawLog, ws: Workspace, *, progress: bool = True) -> list[str]:
    """One partition per day that has events: events of that day, users and ads known by its end."""
    ts = log.events["ts"].cast(pa.int64()).to_numpy()
    day_us = 86_400 * 1_000_000
    first, last = ts[0] // day_us, ts[-1] // day_us
    written = []
    for day_number in tqdm(range(first, last + 1), desc="import days", unit="day", disable=not progress):
        lo, hi = np.searchsorted(ts, [day_number * day_us, (day_number + 1) * day_us])
        if lo == hi:
            continue  # no events that day: no partition (an empty one would read as a volume drop)
        day = dt.date(1970, 1, 1) + dt.timedelta(days=int(day_number))
        end = pa.scalar((day_number + 1) * day_us, TS)
        folder = writer.fresh_partition(ws, "events", day)
        pq.write_table(log.events.slice(lo, hi - lo), folder / writer.EVENTS_FILE)
        writer.write_snapshot(ws, "users", day, log.users.filter(pc.less(log.users["signup_ts"], end)))
        writer.write_snapshot(ws, "ads", day, log.ads.filter(pc.less(log.ads["created_ts"], end)))
        written.append(day.isoformat())
    return written


# ------------------------------------------------------------------------------------------------ conversion


def to_raw(
    interactions: pd.DataFrame,
    fmt: InteractionFormat,
    *,
    items: pd.DataFrame | None = None,
    users: pd.DataFrame | None = None,
) -> RawLog:
    _check_format(fmt, interactions, items, users)
    if interactions.empty:
        raise InteractionFormatError("the interaction log has no rows")
    try:
        frame, quarantined = quarantine_rows(interactions.reset_index(drop=True), fmt)
    except RowFormatError as err:
        raise InteractionFormatError(str(err)) from None
    frame = frame.reset_index(drop=True)
    id_maps: dict[str, pd.DataFrame] = {}
    user_id = _ids(frame[fmt.user_col], fmt.user_col, "user", id_maps)
    item_id = _ids(frame[fmt.item_col], fmt.item_col, "item", id_maps)
    ts_us = _timestamps(frame, fmt, user_id)
    label, strong = _labels(frame, fmt)

    # Sort once by (time, user, input order): event ids and partitions follow this order.
    order = np.lexsort((np.arange(len(frame)), user_id, ts_us))
    frame, user_id, item_id, ts_us = (
        frame.iloc[order].reset_index(drop=True),
        user_id[order],
        item_id[order],
        ts_us[order],
    )
    label = None if label is None else label[order]
    strong = None if strong is None else strong[order]

    events = _events(fmt, user_id, item_id, ts_us, label, strong)
    vocabularies: dict[str, list[str]] = {}
    ads = _ads(frame, fmt, items, item_id, ts_us, vocabularies, id_maps)
    user_table, stats = _users(frame, fmt, users, user_id, ts_us, vocabularies, id_maps)
    stats.update(
        interactions=len(frame),
        events=events.num_rows,
        positives=int(label.sum()) if label is not None else 0,
        conversions=int(strong.sum()) if strong is not None else 0,
        users=user_table.num_rows,
        items=ads.num_rows,
        quarantined=len(quarantined),
        quarantine_reasons=quarantined["reason"].value_counts().to_dict(),
    )
    return RawLog(events, user_table, ads, stats, vocabularies, id_maps, quarantined)


def _check_format(fmt: InteractionFormat, interactions, items, users) -> None:
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
    _require(
        interactions,
        "interactions",
        [fmt.user_col, fmt.item_col, fmt.ts_col, fmt.order_col, fmt.label_col, fmt.rating_col]
        + [fmt.conversion_col]
        + (item_side if items is None else [])
        + (user_side if users is None else []),
    )
    if items is not None:
        _require(items, "items", [fmt.item_col, *item_side])
    if users is not None:
        _require(users, "users", [fmt.user_col, *user_side])


def _require(frame: pd.DataFrame, name: str, columns: list[str | None]) -> None:
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


def _examples(values: pd.Series, bad: np.ndarray) -> str:
    sample = pd.unique(values[bad].astype(str))[:5]
    return f"{int(bad.sum())} row(s) ({rows_text(values.index[bad])}), e.g. {list(sample)}"


def _ids(values: pd.Series, column: str, kind: str, id_maps: dict[str, pd.DataFrame]) -> np.ndarray:
    """Integer ids >= 0 as they are; anything else -> a stable 63-bit hash of the text (recorded in id_maps)."""
    missing = values.isna().to_numpy()
    if missing.any():
        raise InteractionFormatError(f"{column}: {int(missing.sum())} empty {kind} id(s)")
    if pd.api.types.is_float_dtype(values) and (values == np.floor(values)).all():
        values = values.astype(np.int64)  # integers read as floats (a column that had an empty cell)
    if pd.api.types.is_integer_dtype(values):
        ids = values.to_numpy(dtype=np.int64)
        if (ids < 0).any():
            raise InteractionFormatError(f"{column}: negative {kind} id(s): {_examples(values, ids < 0)}")
        return ids
    text = values.astype(str)
    unique = pd.unique(text)
    hashed = np.array([text_id(v) for v in unique], dtype=np.int64)
    if len(np.unique(hashed)) != len(unique):
        raise InteractionFormatError(f"{column}: two {kind} ids hash to the same int64; rename one of them")
    id_maps[kind] = pd.DataFrame({"raw": unique, f"{kind}_id": hashed})
    return hashed[pd.Index(unique).get_indexer(text)]


def _timestamps(frame: pd.DataFrame, fmt: InteractionFormat, user_id: np.ndarray) -> np.ndarray:
    """Microseconds since the epoch (UTC) for every row."""
    if fmt.order_col:
        order = pd.to_numeric(frame[fmt.order_col], errors="coerce")
        bad = order.isna().to_numpy()
        if bad.any():
            raise InteractionFormatError(
                f"{fmt.order_col}: not a number in {_examples(frame[fmt.order_col], bad)}"
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
        raise InteractionFormatError(f"{fmt.ts_col}: not a timestamp in {_examples(raw, bad)}")
    return parsed.dt.floor("us").to_numpy(dtype="datetime64[us]").astype(np.int64)


def _labels(frame: pd.DataFrame, fmt: InteractionFormat) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(label, strong) as bool arrays; (None, None) when the log carries neither label nor rating."""
    rating = None
    if fmt.rating_col:
        rating = pd.to_numeric(frame[fmt.rating_col], errors="coerce")
        bad = rating.isna().to_numpy()
        if bad.any():
            raise InteractionFormatError(
                f"{fmt.rating_col}: not a number in {_examples(frame[fmt.rating_col], bad)}"
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
        raise InteractionFormatError(f"{column}: not a 0/1 {what} in {_examples(frame[column], bad)}")
    return truthy


def _events(fmt, user_id, item_id, ts_us, label, strong) -> pa.Table:
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


def _first_per_key(frame: pd.DataFrame, key: np.ndarray, columns: list[str | None]) -> pd.DataFrame:
    """Attributes given inline on the interactions: per key, the first non-empty value (in time order)."""
    cols = [c for c in columns if c]
    if not cols:
        return pd.DataFrame(index=pd.unique(key))
    return frame[cols].replace("", None).groupby(key, sort=False).first()


def _attribute_table(side, frame, key_col, kind, key, columns, id_maps) -> pd.DataFrame:
    """Attributes per id: from the separate table when given (duplicates are an error), else from the log."""
    if side is None:
        return _first_per_key(frame, key, columns)
    side_maps: dict[str, pd.DataFrame] = {}
    ids = _ids(side[key_col], key_col, kind, side_maps)
    if kind in side_maps:  # text ids of the side table that never occur in the log join the same map
        id_maps[kind] = pd.concat([id_maps.get(kind), side_maps[kind]]).drop_duplicates("raw")
    duplicated = pd.Series(ids).duplicated().to_numpy()
    if duplicated.any():
        raise InteractionFormatError(
            f"{kind}s table: duplicate {key_col} in {_examples(side[key_col], duplicated)}"
        )
    if not np.isin(key, ids).any():
        raise InteractionFormatError(
            f"{kind}s table: none of its {key_col} values occurs in the interaction log (different id types?)"
        )
    table = side[[c for c in columns if c]].copy()
    table.index = ids
    return table


def _ads(frame, fmt, items, item_id, ts_us, vocabularies, id_maps) -> pa.Table:
    attrs = _attribute_table(
        items, frame, fmt.item_col, "item", item_id, [fmt.item_attrs_col, fmt.advertiser_col], id_maps
    )
    first_seen = pd.Series(ts_us).groupby(item_id).min()
    ids = np.union1d(first_seen.index.to_numpy(), attrs.index.to_numpy())
    attrs = attrs.reindex(ids)
    start = (int(ts_us.min()) // 86_400_000_000) * 86_400_000_000
    created = first_seen.reindex(ids).fillna(start).to_numpy(dtype=np.int64)

    token_lists = _token_lists(
        attrs[fmt.item_attrs_col] if fmt.item_attrs_col else pd.Series(index=ids, dtype=object), fmt.attr_sep
    )
    vocabulary = sorted({t for tokens in token_lists for t in tokens})
    vocabularies["category"] = vocabulary
    index = {t: i for i, t in enumerate(vocabulary)}
    categories = [[index[t] for t in tokens] for tokens in token_lists]
    advertiser = (
        _advertisers(attrs[fmt.advertiser_col], fmt.advertiser_col, vocabularies)
        if fmt.advertiser_col
        else np.zeros(len(ids), dtype=np.int64)
    )
    return pa.Table.from_arrays(
        [
            pa.array(ids.astype(np.int64)),
            pa.array(advertiser),
            pa.array(np.array([c[0] for c in categories], dtype=np.int32)),
            pa.array(categories, pa.list_(pa.int32())),
            pa.array(np.full(len(ids), 0.5, dtype=np.float32)),
            pa.array(created, TS),
        ],
        schema=SCHEMAS["ads"],
    )


def _token_lists(values: pd.Series, sep: str) -> list[list[str]]:
    """Attribute lists in their given order, de-duplicated; an empty one becomes [NONE_TOKEN]."""
    out = []
    for value in values.tolist():
        if isinstance(value, list | tuple | np.ndarray):
            tokens = [str(v).strip() for v in value]
        elif value is None or (isinstance(value, float) and np.isnan(value)):
            tokens = []
        else:
            tokens = [t.strip() for t in str(value).split(sep)]
        tokens = list(dict.fromkeys(t for t in tokens if t))
        out.append(tokens or [NONE_TOKEN])
    return out


def _advertisers(values: pd.Series, column: str, vocabularies: dict[str, list[str]]) -> np.ndarray:
    """Integer values (e.g. a release year) as they are, missing -> 0; text -> 1 + index in sorted vocabulary."""
    numbers = pd.to_numeric(values, errors="coerce")
    text_present = values.notna().to_numpy() & numbers.isna().to_numpy()
    if not text_present.any():
        whole = numbers.dropna()
        if (whole != np.floor(whole)).any() or (whole < 0).any():
            bad = (numbers.notna() & ((numbers != np.floor(numbers)) | (numbers < 0))).to_numpy()
            raise InteractionFormatError(
                f"{column}: advertiser values must be integers >= 0 or text: {_examples(values, bad)}"
            )
        return numbers.fillna(0).to_numpy(dtype=np.int64)
    text = values.astype("string").fillna("")
    vocabulary = sorted(set(text) - {""})
    vocabularies["advertiser"] = vocabulary
    index = {t: i + 1 for i, t in enumerate(vocabulary)}
    return np.array([index.get(t, 0) for t in text], dtype=np.int64)


def _users(frame, fmt, users, user_id, ts_us, vocabularies, id_maps) -> tuple[pa.Table, dict[str, int]]:
    attrs = _attribute_table(
        users, frame, fmt.user_col, "user", user_id, [fmt.age_col, fmt.gender_col, fmt.country_col], id_maps
    )
    first_seen = pd.Series(ts_us).groupby(user_id).min()
    ids = np.union1d(first_seen.index.to_numpy(), attrs.index.to_numpy())
    attrs = attrs.reindex(ids)
    start = (int(ts_us.min()) // 86_400_000_000) * 86_400_000_000
    signup = first_seen.reindex(ids).fillna(start).to_numpy(dtype=np.int64)
    stats = {"ages_missing": 0, "ages_clipped": 0}

    age = np.full(len(ids), fmt.default_age, dtype=np.float64)
    if fmt.age_col:
        parsed = pd.to_numeric(attrs[fmt.age_col], errors="coerce")
        bad = (parsed.isna() & attrs[fmt.age_col].notna()).to_numpy()
        if bad.any():
            raise InteractionFormatError(
                f"{fmt.age_col}: not a number in {_examples(attrs[fmt.age_col], bad)}"
            )
        stats["ages_missing"] = int(parsed.isna().sum())
        age = parsed.fillna(fmt.default_age).to_numpy(dtype=np.float64)
        # The contract's range is 13..100 (e.g. MovieLens has 7-year-olds): clip, and say how many.
        stats["ages_clipped"] = int(((age < 13) | (age > 100)).sum())
    age = np.clip(np.round(age), 13, 100).astype(np.int16)

    gender = np.zeros(len(ids), dtype=np.int32)
    if fmt.gender_col:
        gender = _genders(attrs[fmt.gender_col], fmt.gender_col)
    country = np.zeros(len(ids), dtype=np.int32)
    if fmt.country_col:
        text = attrs[fmt.country_col].astype("string").fillna(NONE_TOKEN).str.strip().replace("", NONE_TOKEN)
        vocabulary = sorted(set(text))
        vocabularies["country"] = vocabulary
        country = pd.Index(vocabulary).get_indexer(text).astype(np.int32)
    table = pa.Table.from_arrays(
        [
            pa.array(ids.astype(np.int64)),
            pa.array(age),
            writer.strings(gender, GENDERS),
            pa.array(country),
            pa.array(signup, TS),
        ],
        schema=SCHEMAS["users"],
    )
    return table, stats


def _genders(values: pd.Series, column: str) -> np.ndarray:
    text = values.astype("string").fillna("").str.strip().str.lower()
    code = np.full(len(text), -1, dtype=np.int32)
    for name, spellings in GENDER_SPELLINGS.items():
        code[text.isin(spellings).to_numpy()] = GENDERS.index(name)
    bad = code < 0
    if bad.any():
        raise InteractionFormatError(
            f"{column}: unknown gender in {_examples(values, bad)}; accepted: {GENDER_SPELLINGS}"
        )
    return code
