"""Training sets for the user model and the ranker, written to ``ws.training(name)/``:

- ``sequences.parquet``: one row per user: ``user_id`` + one list<int64> column per HISTORY_FIELDS field
  (``ad_id, action, surface, category_id, advertiser_id, ts``; action/surface as vocabulary ids, ts in seconds),
  every accepted event up to the end date, sorted by (ts, event_id);
- ``examples.parquet``: one row per impression in [start, end]: ``example_id`` (the event id), ``user_id``,
  ``user_row`` (row in sequences), ``cut`` (that user's events strictly before the example's second: the history
  is ``[max(0, cut - L), cut)``), ``ad_id, advertiser_id, category_id, quality, surface, ts`` (seconds),
  ``click, conversion, split`` (``split="time"``: train / valid / test by day, the last days held out;
  ``split="leave-one-out"``: per user, the last positive is test and the second-last valid);
- ``items.parquet``: one row per ad known at the end date: ``ad_id, advertiser_id, category_id`` and every
  attribute (``categories``), so a model can tokenize all of an item's attributes, not only the first;
- ``ranker.parquet``: the examples plus ``event_timestamp`` joined point in time (Feast
  ``get_historical_features(..., filter_by_created_timestamp=True)``, feature service ``ranker_training``) with
  ad stats, ad attributes, user profile, recent events and the user embedding + model_version (null when the
  embedding stage has not written any);
- ``vocabulary.npz``: raw ``user_id`` / ``ad_id`` -> model rows (``features.vocabulary``), built from the
  training period only;
- ``manifest.json``: vocab sizes (rows per model table), counts, date range, feature refs, config.

``engine: spark`` (``--set engine=spark``) runs the engine step (accepted-events read, histories, examples with
their cuts and splits, vocabulary counts, the point-in-time feature join, and the writing of ``sequences``,
``examples`` and ``ranker`` parquet) on Spark's executors (``features.spark.training_sets``); items and the
manifest are shared with the local engine, and the files come out value-identical
(``tests/features/test_spark_engine.py``).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from features.feature_repo import FEATURE_TABLES, FeatureStoreConfig
from features.feature_repo.offline import PARQUET_OPTIONS, partition_days, read_partition
from features.feature_repo.tables import EVENT_TS
from features.histories import SECOND_US, build_histories, cut_points
from features.schema import ACTIONS, GENDERS, SURFACES
from features.spark.session import SparkConfig, check_engine
from features.splits import SPLIT_MODES, leave_one_out_split
from features.stats import read_events
from features.vocabulary import ID_FIELDS, Vocabulary, VocabularyConfig, VocabularyError, save_vocabularies
from gemflow.config import save_config, to_dict
from gemflow.workspace import Workspace

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
EXAMPLE_SCHEMA = pa.schema(
    [(name, pa.int64()) for name in ("example_id", "user_id", "user_row", "cut", "ad_id", "advertiser_id")]
    + [("category_id", pa.int64()), ("quality", pa.float32()), ("surface", pa.int64()), ("ts", pa.int64())]
    + [("click", pa.int8()), ("conversion", pa.int8()), ("split", pa.string())]
)
EXAMPLE_COLUMNS = tuple(EXAMPLE_SCHEMA.names)
# what an engine keeps per example for the Feast join: the files' columns + the event's own timestamp
EXAMPLE_PARTS_SCHEMA = EXAMPLE_SCHEMA.append(pa.field(EVENT_TS, pa.timestamp("us", tz="UTC")))
EMBEDDING_VIEW = "user_embedding"


@dataclass
class TrainingSetConfig:
    name: str = "default"
    start: str = ""  # first example day, YYYY-MM-DD; "" = the first accepted partition
    end: str = ""  # last example day (inclusive); "" = the latest accepted partition
    split: str = "time"  # "time" | "leave-one-out" (positive-only sequence logs; no days are held out)
    valid_days: int = 1  # split "time": the days before the test days
    test_days: int = 1  # split "time": the last days of the range
    history_start: str = ""  # earliest day read into histories; "" = every accepted partition up to ``end``
    join_features: bool = True  # write ranker.parquet (Feast point-in-time join)
    feature_service: str = "ranker_training"
    feature_store: FeatureStoreConfig = field(default_factory=FeatureStoreConfig)
    vocabulary: VocabularyConfig = field(default_factory=VocabularyConfig)  # raw ids -> model rows
    engine: str = "local"  # local (pandas/pyarrow, one process) | spark (features.spark; same outputs)
    spark: SparkConfig = field(default_factory=SparkConfig)  # engine: spark only

    def dates(self, available: list[dt.date] | None = None) -> tuple[dt.date, dt.date]:
        """[start, end]; an empty bound is the first / latest of ``available`` accepted partitions."""
        try:
            start = dt.date.fromisoformat(self.start) if self.start or not available else min(available)
            end = dt.date.fromisoformat(self.end) if self.end or not available else max(available)
        except ValueError as err:
            raise ValueError(
                f"training set: start/end must be dates like 2026-01-31, got {self.start!r}, {self.end!r}"
            ) from err
        if end < start:
            raise ValueError(f"training set: end {end} is before start {start}")
        if self.split not in SPLIT_MODES:
            raise ValueError(f"training set: split must be one of {list(SPLIT_MODES)}, got {self.split!r}")
        check_engine(self.engine)
        if self.valid_days < 0 or self.test_days < 0:
            raise ValueError("training set: valid_days and test_days must be >= 0")
        return start, end


def _split(day_ordinal: np.ndarray, end: dt.date, cfg: TrainingSetConfig) -> np.ndarray:
    test_from = end.toordinal() - cfg.test_days + 1
    valid_from = test_from - cfg.valid_days
    return np.where(day_ordinal >= test_from, "test", np.where(day_ordinal >= valid_from, "valid", "train"))


def build_examples(events: pd.DataFrame, histories, start: dt.date, end: dt.date, cfg) -> pd.DataFrame:
    in_range = (events["day"] >= start.toordinal()) & (events["day"] <= end.toordinal())
    imp = events[in_range & (events["action"] == ACTIONS.index("impression"))]
    ts_seconds = imp["ts_us"].to_numpy(np.int64) // SECOND_US
    user_row, cut = cut_points(histories, imp["user_id"].to_numpy(), ts_seconds)
    return examples_frame(imp, user_row, cut, end, cfg)


def examples_frame(
    imp: pd.DataFrame, user_row: np.ndarray, cut: np.ndarray, end: dt.date, cfg
) -> pd.DataFrame:
    """The example rows of impressions ``imp`` (columns of ``read_events``) given each one's history row and
    cut, in (ts, example_id) order (``features.spark.examples`` is the Spark engine's)."""
    ts_seconds = imp["ts_us"].to_numpy(np.int64) // SECOND_US
    examples = pd.DataFrame(
        {
            "example_id": imp["event_id"].to_numpy(np.int64),
            "user_id": imp["user_id"].to_numpy(np.int64),
            "user_row": user_row,
            "cut": cut,
            "ad_id": imp["ad_id"].to_numpy(np.int64),
            "advertiser_id": imp["advertiser_id"].to_numpy(np.int64),
            "category_id": imp["category_id"].to_numpy(np.int64),
            "quality": imp["quality"].to_numpy(np.float32),
            "surface": imp["surface"].to_numpy(np.int64),
            "ts": ts_seconds,
            "click": imp["click"].to_numpy(np.int8),
            "conversion": imp["conversion"].to_numpy(np.int8),
            "split": _split(imp["day"].to_numpy(np.int64), end, cfg),
        }
    )
    examples[EVENT_TS] = imp["ts"].to_numpy()
    order = np.lexsort((examples["example_id"].to_numpy(), imp["ts_us"].to_numpy()))
    return examples.iloc[order].reset_index(drop=True)


def feature_store_refs(ws: Workspace, cfg: TrainingSetConfig) -> tuple:
    """The applied feature store and the refs of ``cfg.feature_service`` a ranker set joins (the embedding view
    only once an embedding refresh has written it)."""
    from features.store import open_store

    store = open_store(ws, cfg.feature_store, apply=True)
    with_embedding = bool(partition_days(ws, "offline", EMBEDDING_VIEW))
    refs = []
    for projection in store.get_feature_service(cfg.feature_service).feature_view_projections:
        if projection.name == EMBEDDING_VIEW and not with_embedding:
            continue
        refs += [f"{projection.name}:{f.name}" for f in projection.features]
    return store, refs


def ranker_schema(examples: pa.Schema, refs: list[str]) -> pa.Schema:
    fields = list(examples)
    for ref in refs:
        view, name = ref.split(":")
        fields.append(FEATURE_TABLES[view].field(name).with_nullable(True))
    for name in ("user_embedding", "model_version"):
        if f"{EMBEDDING_VIEW}:{name}" not in refs:
            fields.append(FEATURE_TABLES[EMBEDDING_VIEW].field(name).with_nullable(True))
    return pa.schema(fields)


def join_features(
    ws: Workspace, examples: pd.DataFrame, cfg: TrainingSetConfig
) -> tuple[pa.Table, list[str]]:
    """The examples joined point in time with the feature service (no row later than its example)."""
    store, refs = feature_store_refs(ws, cfg)
    # Feast keys its join on (entities, timestamp): send each distinct key once, then map back to examples.
    keys = examples[["user_id", "ad_id", EVENT_TS]].drop_duplicates(ignore_index=True)
    features = store.get_historical_features(
        entity_df=keys, features=refs, full_feature_names=False, filter_by_created_timestamp=True
    ).to_df()
    if len(features) != len(keys):
        raise RuntimeError(f"feast returned {len(features)} rows for {len(keys)} entity rows")
    features[EVENT_TS] = features[EVENT_TS].astype(examples[EVENT_TS].dtype)
    joined = examples.merge(features, on=["user_id", "ad_id", EVENT_TS], how="left", validate="many_to_one")
    for name in ("user_embedding", "model_version"):
        if name not in joined.columns:
            joined[name] = None
    # the caller's columns (examples, or a skew check's request keys), event_timestamp in µs as the offline store
    # keeps it and the Spark engine writes it
    base = pa.Schema.from_pandas(examples, preserve_index=False)
    stamp = base.get_field_index(EVENT_TS)
    schema = ranker_schema(base.set(stamp, pa.field(EVENT_TS, pa.timestamp("us", tz="UTC"))), refs)
    table = pa.Table.from_pandas(joined[schema.names], schema=schema, preserve_index=False)
    return table, refs


def training_period(events: pd.DataFrame, examples: pd.DataFrame, end: dt.date, cfg) -> pd.DataFrame:
    """The events a model may learn ids from: before the first held-out day (split "time"), or every event
    but the held-out examples themselves (split "leave-one-out")."""
    if cfg.split == "time":
        return events[events["day"] < first_held_out_day(end, cfg)]
    return events[~events["event_id"].isin(held_out_ids(examples))]


def first_held_out_day(end: dt.date, cfg) -> int:
    """Split "time": the ordinal of the first valid/test day (the training period ends before it)."""
    return end.toordinal() - cfg.test_days - cfg.valid_days + 1


def held_out_ids(examples: pd.DataFrame) -> np.ndarray:
    return examples.loc[examples["split"] != "train", "example_id"].to_numpy()


def build_vocabularies(period: pd.DataFrame, cfg: VocabularyConfig) -> dict[str, Vocabulary]:
    """One vocabulary per entity id (``ID_FIELDS``), counted over the training period's events."""
    return {f: Vocabulary.build(f, period[f].to_numpy(np.int64), cfg) for f in ID_FIELDS}


def _vocab(max_ids: dict[str, int], vocabularies: dict[str, Vocabulary], max_rows: int) -> dict[str, int]:
    vocab = {
        "user_id": vocabularies["user_id"].size,
        "ad_id": vocabularies["ad_id"].size,
        "advertiser_id": max_ids["advertiser_id"] + 1,
        "category_id": max_ids["category_id"] + 1,
        "action": len(ACTIONS),
        "surface": len(SURFACES),
        "gender": len(GENDERS),
    }
    if "user_country" in max_ids:  # joined from the user profile (ranker sets)
        vocab["country"] = max_ids["user_country"] + 1
    for name, rows in vocab.items():  # attribute ids are used as rows directly: refuse a huge table here
        if rows > max_rows:
            raise VocabularyError(
                f"{name}: ids up to {rows - 1:,} would need a table of {rows:,} rows, over "
                f"vocabulary.max_rows {max_rows:,}; re-import with small ids for {name} or raise the limit"
            )
    return vocab


def _items(ws: Workspace, end: dt.date) -> pa.Table:
    """The ads known at ``end`` (the latest accepted ads partition up to it) with all their attributes."""
    days = [d for d in partition_days(ws, "offline", "ads") if d <= end]
    columns = ["ad_id", "advertiser_id", "category_id", "categories"]
    if not days:
        return pa.table(
            {c: pa.array([], pa.list_(pa.int32()) if c == "categories" else pa.int64()) for c in columns}
        )
    return read_partition(ws.offline("ads", days[-1]), columns).sort_by("ad_id")


def write_table_file(table: pa.Table, path: Path) -> None:
    """One training-set file, written whole and renamed into place (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table.replace_schema_metadata(None), tmp, **PARQUET_OPTIONS)
    tmp.replace(path)


@dataclass
class EngineOutput:
    """What an engine's step leaves besides its files (``sequences``, ``examples``, ``ranker`` parquet)."""

    vocabularies: dict[str, Vocabulary]
    counts: dict[str, int]  # users, events, examples, examples_<split>, clicks, conversions
    # advertiser_id, category_id: the largest in the histories; user_country: in ranker.parquet, when joined
    max_ids: dict[str, int]  # -1: none
    feature_refs: list[str]  # what ranker.parquet joined ([]: not asked)


def examples_table(examples: pd.DataFrame) -> pa.Table:
    """``examples.parquet``'s rows from the local engine's example frame."""
    return pa.Table.from_pandas(examples[list(EXAMPLE_COLUMNS)], schema=EXAMPLE_SCHEMA, preserve_index=False)


def example_counts(examples: pd.DataFrame) -> dict[str, int]:
    split_counts = examples["split"].value_counts()
    return {
        "examples": len(examples),
        **{f"examples_{s}": int(split_counts.get(s, 0)) for s in SPLITS},
        "clicks": int(examples["click"].sum()),
        "conversions": int(examples["conversion"].sum()),
    }


def _local_engine(ws: Workspace, days: list[dt.date], start: dt.date, end: dt.date, cfg, out: Path):
    """``build_training_set``'s engine step in this process (pandas / numpy)."""
    events = read_events(ws, days)
    histories = build_histories(events)
    examples = build_examples(events, histories, start, end, cfg)
    if cfg.split == "leave-one-out":
        examples["split"] = leave_one_out_split(examples)
    vocabularies = build_vocabularies(training_period(events, examples, end, cfg), cfg.vocabulary)
    del events
    write_table_file(histories.to_arrow(), out / "sequences.parquet")
    write_table_file(examples_table(examples), out / "examples.parquet")
    values = histories.values
    max_ids = {k: int(values[k].max()) if len(values[k]) else -1 for k in ("advertiser_id", "category_id")}
    refs = []
    if cfg.join_features:
        ranker, refs = join_features(ws, examples, cfg)
        write_table_file(ranker, out / "ranker.parquet")
        if "user_country" in ranker.column_names:
            country = ranker.column("user_country").drop_null().to_numpy()
            max_ids["user_country"] = int(country.max()) if len(country) else -1
    return EngineOutput(
        vocabularies=vocabularies,
        counts={
            "users": len(histories.user_ids),
            "events": int(histories.offsets[-1]),
            **example_counts(examples),
        },
        max_ids=max_ids,
        feature_refs=refs,
    )


def build_training_set(ws: Workspace, cfg: TrainingSetConfig) -> dict:
    """Build and write the training set ``cfg.name``; returns its manifest."""
    t0 = time.perf_counter()
    start, end = cfg.dates(partition_days(ws, "offline", "events"))
    history_start = dt.date.fromisoformat(cfg.history_start) if cfg.history_start else dt.date.min
    days = [d for d in partition_days(ws, "offline", "events") if history_start <= d <= end]
    example_days = [d for d in days if d >= start]
    if not example_days:
        raise FileNotFoundError(
            f"no accepted event partitions between {start} and {end} under "
            f"{ws.offline('events')}: run `gemflow ingest --date D` first"
        )
    if cfg.split == "time" and (
        len({d for d in example_days if d.toordinal() <= end.toordinal() - cfg.test_days - cfg.valid_days})
        == 0
    ):
        raise ValueError(
            f"training set {start}..{end}: no train days left after holding out "
            f"{cfg.valid_days} valid + {cfg.test_days} test day(s); a positive-only log (one day, or no "
            "timestamps) splits per user instead: --split leave-one-out"
        )
    out = ws.training(cfg.name)
    out.mkdir(parents=True, exist_ok=True)
    log.info("training set %s: %d history day(s), examples %s..%s", cfg.name, len(days), start, end)

    if cfg.engine == "spark":
        from features.spark.training_sets import write_training_files

        step = write_training_files(ws, days, start, end, cfg, out)
    else:
        step = _local_engine(ws, days, start, end, cfg, out)
    save_vocabularies(step.vocabularies, out)
    write_table_file(_items(ws, end), out / "items.parquet")

    manifest = {
        "name": cfg.name,
        "start": start.isoformat(),
        "end": end.isoformat(),
        "history_days": [days[0].isoformat(), days[-1].isoformat()],
        "counts": step.counts,
        "vocab_sizes": _vocab(step.max_ids, step.vocabularies, cfg.vocabulary.max_rows),
        "vocabulary": {f: {"rows": v.size, "hash_buckets": v.buckets} for f, v in step.vocabularies.items()},
        "split": cfg.split,
        "history_fields": ["ad_id", "action", "surface", "category_id", "advertiser_id", "ts"],
        "feature_refs": step.feature_refs,
        "files": sorted(p.name for p in out.glob("*.parquet")),
        "config": to_dict(cfg),
        "seconds": round(time.perf_counter() - t0, 2),
        "created_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    save_config(cfg, out)
    log.info("training set %s: %s", cfg.name, manifest["counts"])
    return manifest
