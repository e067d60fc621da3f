"""The ads and users tables of an imported log: attributes from the log or from separate item/user tables.

Items become ads (advertiser = a chosen item column or 0, categories = the attribute list, the first one is
``category_id``, quality 0.5); categorical attributes become small ids by their sorted vocabulary, which is
recorded for the run folder.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from features.schema import GENDERS, SCHEMAS, TS
from features.sources import writer
from features.sources.interaction_columns import entity_ids, examples
from features.sources.interaction_format import InteractionFormatError

NONE_TOKEN = "<none>"  # the category / country of rows that have none
GENDER_SPELLINGS = {
    "male": ("m", "male", "man"),
    "female": ("f", "female", "woman"),
    "unknown": ("", "u", "unknown", "na", "n/a", "none"),
}


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
    ids = entity_ids(side[key_col], key_col, kind, side_maps)
    if kind in side_maps:  # text ids of the side table that never occur in the log join the same map
        id_maps[kind] = pd.concat([id_maps.get(kind), side_maps[kind]]).drop_duplicates("raw")
    duplicated = pd.Series(ids).duplicated().to_numpy()
    if duplicated.any():
        raise InteractionFormatError(
            f"{kind}s table: duplicate {key_col} in {examples(side[key_col], duplicated)}"
        )
    if not np.isin(key, ids).any():
        raise InteractionFormatError(
            f"{kind}s table: none of its {key_col} values occurs in the interaction log (different id types?)"
        )
    table = side[[c for c in columns if c]].copy()
    table.index = ids
    return table


def ads_table(frame, fmt, items, item_id, ts_us, vocabularies, id_maps) -> pa.Table:
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
                f"{column}: advertiser values must be integers >= 0 or text: {examples(values, bad)}"
            )
        return numbers.fillna(0).to_numpy(dtype=np.int64)
    text = values.astype("string").fillna("")
    vocabulary = sorted(set(text) - {""})
    vocabularies["advertiser"] = vocabulary
    index = {t: i + 1 for i, t in enumerate(vocabulary)}
    return np.array([index.get(t, 0) for t in text], dtype=np.int64)


def users_table(frame, fmt, users, user_id, ts_us, vocabularies, id_maps) -> tuple[pa.Table, dict[str, int]]:
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
                f"{fmt.age_col}: not a number in {examples(attrs[fmt.age_col], bad)}"
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
            f"{column}: unknown gender in {examples(values, bad)}; accepted: {GENDER_SPELLINGS}"
        )
    return code
