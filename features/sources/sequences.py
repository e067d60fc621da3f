"""Positive-only sequence files -> the raw contract, through the generic importer.

The common public format of sequential recommendation (the S3-Rec copies of Amazon Sports / Toys, many
SASRec / BERT4Rec releases): one user per line, ``user_id item_1 item_2 ... item_n`` in chronological order,
and optionally an item-attribute file, JSON ``{"item_id": [attribute, ...]}``. There are no timestamps: the
order is all there is, so the importer's order-only mode gives each user's k-th item the time ``base_date`` +
k minutes, and every row is a positive (``positive_only``: one impression with click = 1 per interaction).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pandas as pd

from features.sources.interaction_format import InteractionFormat, InteractionFormatError
from features.sources.interactions import import_interactions
from gemflow.workspace import Workspace

SEQUENCE_FORMAT = InteractionFormat(
    user_col="user_id",
    item_col="item_id",
    order_col="position",
    item_attrs_col="attributes",
    positive_only=True,
)


def _open(path: Path):
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def read_sequences(path: str | Path) -> pd.DataFrame:
    """One row per interaction: ``user_id``, ``item_id`` (text, as written) and ``position`` within the user."""
    path = Path(path)
    if not path.exists():
        raise InteractionFormatError(f"{path}: no such file")
    users, items, positions = [], [], []
    with _open(path) as lines:
        for number, line in enumerate(lines, 1):
            tokens = line.split()
            if not tokens:
                continue
            if len(tokens) < 2:
                raise InteractionFormatError(f"{path}:{number}: a user with no items ({line.strip()!r})")
            users += [tokens[0]] * (len(tokens) - 1)
            items += tokens[1:]
            positions += range(len(tokens) - 1)
    if not users:
        raise InteractionFormatError(f"{path}: no sequences")
    return pd.DataFrame({"user_id": users, "item_id": items, "position": positions})


def read_item_attributes(path: str | Path) -> pd.DataFrame:
    """``item_id`` (text) and ``attributes`` (a list of attribute ids as text) from the JSON attribute file."""
    path = Path(path)
    if not path.exists():
        raise InteractionFormatError(f"{path}: no such file")
    with _open(path) as f:
        try:
            table = json.load(f)
        except json.JSONDecodeError as err:
            raise InteractionFormatError(f"{path}: not JSON ({err})") from err
    if not isinstance(table, dict) or not all(isinstance(v, list) for v in table.values()):
        raise InteractionFormatError(f'{path}: expected {{"item_id": [attribute, ...]}}')
    return pd.DataFrame(
        {"item_id": list(table), "attributes": [[str(a) for a in attrs] for attrs in table.values()]}
    )


def _as_ints(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """Ids that are all decimal integers stay integers (kept as they are by the importer), else text."""
    numeric = pd.to_numeric(frame[column], errors="coerce")
    if numeric.notna().all() and (numeric >= 0).all():
        frame[column] = numeric.astype("int64")
    return frame


def import_sequences(
    sequences: str | Path,
    ws: Workspace,
    *,
    item_attributes: str | Path | None = None,
    fmt: InteractionFormat = SEQUENCE_FORMAT,
    progress: bool = True,
) -> dict[str, Any]:
    """Import a sequence file (and its item attributes) into ``ws``; returns the importer's summary."""
    frame = _as_ints(read_sequences(sequences), "user_id")
    frame = _as_ints(frame, "item_id")
    items = None
    if item_attributes is not None:
        items = read_item_attributes(item_attributes)
        if pd.api.types.is_integer_dtype(frame["item_id"]):
            items = _as_ints(items, "item_id")
    else:
        fmt = InteractionFormat(**{**fmt.__dict__, "item_attrs_col": None})
    return import_interactions(frame, fmt, ws, items=items, source="sequences", progress=progress)
