"""MovieLens-100K -> the raw contract, through the generic importer (``features.sources.interactions``).

Reads RecBole's atomic TSV files ``ml-100k.{inter,item,user}.gz`` from ``../shared/data/movielens-100k`` (see its
SOURCE.md: research use only, never copied into this repository). Mapping: every rating is an impression on the
``feed`` surface; rating >= 4 is a click (55,375 of 100,000), rating == 5 also a conversion; the genres are the
ad's categories (the first genre is ``category_id``), the release year is the ``advertiser_id`` (0 for the
two items without a usable year); age, gender and occupation (as ``country``) form the user profile. Ages under 13 (the youngest
rater is 7) are clipped to the contract's 13. Day partitions span 1997-09-20 .. 1998-04-22. ``positive_only``: every
rating is one positive interaction (the sequential-recommendation reading of the set), no labels.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Any

import pandas as pd

from features.sources.interaction_format import InteractionFormat
from features.sources.interactions import import_interactions
from gemflow.workspace import Workspace

DEFAULT_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "movielens-100k"
FILES = {"inter": "ml-100k.inter.gz", "item": "ml-100k.item.gz", "user": "ml-100k.user.gz"}

MOVIELENS_FORMAT = InteractionFormat(
    user_col="user_id",
    item_col="item_id",
    ts_col="timestamp",
    rating_col="rating",
    positive_rating=4,
    strong_rating=5,
    item_attrs_col="class",
    attr_sep=" ",
    advertiser_col="release_year",
    age_col="age",
    gender_col="gender",
    country_col="occupation",
    surface="feed",
)


def read_atomic(path: Path) -> pd.DataFrame:
    """A RecBole atomic file: tab-separated, header names carry a type suffix (``user_id:token``)."""
    frame = pd.read_csv(path, sep="\t", quoting=csv.QUOTE_NONE, encoding="utf-8")
    return frame.rename(columns=lambda name: name.split(":", 1)[0])


def load(data_dir: Path = DEFAULT_DIR) -> dict[str, pd.DataFrame]:
    data_dir = Path(data_dir)
    missing = [name for name in FILES.values() if not (data_dir / name).exists()]
    if missing:
        raise FileNotFoundError(
            f"MovieLens-100K files {missing} not found in {data_dir} (they live in ../shared/data, never in the repo)"
        )
    tables = {kind: read_atomic(data_dir / name) for kind, name in FILES.items()}
    # Two items carry no usable year ("unkonwn", and "V" from a mis-split title): they get advertiser 0.
    tables["item"]["release_year"] = pd.to_numeric(tables["item"]["release_year"], errors="coerce").astype(
        "Int64"
    )
    return tables


# The sequential-recommendation reading (SASRec, BERT4Rec): every rating is an interaction, whatever its value.
POSITIVE_ONLY_FORMAT = dataclasses.replace(
    MOVIELENS_FORMAT, rating_col=None, positive_rating=None, strong_rating=None, positive_only=True
)


def import_movielens(
    ws: Workspace, data_dir: Path = DEFAULT_DIR, *, progress: bool = True, positive_only: bool = False
) -> dict[str, Any]:
    tables = load(data_dir)
    return import_interactions(
        tables["inter"],
        POSITIVE_ONLY_FORMAT if positive_only else MOVIELENS_FORMAT,
        ws,
        items=tables["item"],
        users=tables["user"],
        source="movielens-100k",
        progress=progress,
    )
