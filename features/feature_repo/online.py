"""Fast online writes: Feast's materialize and push semantics, Feast's storage layout, values encoded vectorized.

Feast spends ~45 µs per value converting rows to protobuf objects and writing them one statement at a time. Here
the same bytes come from ``features.feature_repo.encoding`` and go to the same store in bulk:

- SQLite: Feast's table and upsert statement (``executemany``), the same ``value``, ``value_text``, ``event_ts``,
  ``created_ts`` per (entity key, feature);
- Redis: Feast's key, field hashes and ``_ts:<view>`` timestamp in one pipeline, skipping an entity whose stored
  timestamp is as new or newer (Feast's dedup), with its ``key_ttl_seconds`` and ``skip_dedup`` settings.

``materialize`` reads the view's source like Feast's local engine (rows with ``start <= ts <= end``, the latest per
entity by (ts, created ts)) and records the interval in the registry; ``push`` writes a table like
``FeatureStore.push(..., to=ONLINE)``. Anything the fast path does not reproduce exactly (another store, table
layout or type, a null) falls back to Feast's own call for that view, and so does any other failure of the fast
path: it leans on Feast internals (``_get_conn``, ``_table_id``, ``_mmh3``, ...) that a Feast upgrade may move, and a
moved internal must cost speed, not the ingestion (one warning names why). Rows that lack the view's columns are
bad input and stay an error. Feast's readers see identical data: ``tests/features/test_online_writes.py``
compares both paths on SQLite and Redis.
"""

from __future__ import annotations

import datetime as dt
import glob
import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from feast import FeatureStore, FeatureView, FileSource
from feast.types import Int64

from features.feature_repo.encoding import UnsupportedForFastWrite, encode_values, entity_keys, value_texts

log = logging.getLogger(__name__)

REDIS_CHUNK = 20_000  # entities per Redis pipeline round trip
_warned: set[str] = set()  # fast-path failures already warned about
SQLITE_COLUMNS = {
    "entity_key",
    "feature_name",
    "value",
    "value_text",
    "vector_value",
    "event_ts",
    "created_ts",
}


@dataclass
class EncodedRows:
    """One view's rows as the online store keeps them."""

    keys: list[bytes]  # serialized entity keys
    values: dict[str, list[bytes]]  # feature -> serialized ValueProto per row
    texts: dict[str, list[str | None]]  # feature -> SQLite value_text per row
    event_us: np.ndarray  # event timestamps, int64 microseconds since the epoch (UTC)
    created_us: np.ndarray | None


def _join_key(view: FeatureView) -> str:
    columns = view.entity_columns
    if len(columns) != 1 or columns[0].dtype != Int64:
        raise UnsupportedForFastWrite(f"view {view.name!r} needs exactly one Int64 join key")
    return columns[0].name


def _micros(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if column.null_count:
        raise UnsupportedForFastWrite("null timestamps")
    return pc.cast(column, pa.timestamp("us", tz="UTC")).cast(pa.int64()).to_numpy(zero_copy_only=False)


def check_rows(view: FeatureView, table: pa.Table) -> None:
    """Bad input for either writer: the view's columns missing, or null join keys."""
    keys = [c.name for c in view.entity_columns]
    needed = [*keys, *(f.name for f in view.features), view.batch_source.timestamp_field]
    missing = [c for c in needed if c not in table.column_names]
    if missing:
        raise ValueError(f"rows for view {view.name!r} lack column(s) {missing}; it needs {needed}")
    for key in keys:
        nulls = table.column(key).null_count
        if nulls:
            raise ValueError(f"rows for view {view.name!r} have {nulls} null {key}(s)")


def encode_rows(store: FeatureStore, view: FeatureView, table: pa.Table) -> EncodedRows:
    """Encode ``table`` (join key, every feature of ``view``, its timestamp columns) for ``view``."""
    source = view.batch_source
    join_key = _join_key(view)
    check_rows(view, table)
    ids = table.column(join_key)
    created = source.created_timestamp_column
    return EncodedRows(
        keys=entity_keys(
            join_key, ids.to_numpy().astype(np.int64), store.config.entity_key_serialization_version
        ),
        values={f.name: encode_values(table.column(f.name), f.dtype, f.name) for f in view.features},
        texts={f.name: value_texts(table.column(f.name), f.dtype) for f in view.features},
        event_us=_micros(table.column(source.timestamp_field)),
        created_us=_micros(table.column(created)) if created and created in table.column_names else None,
    )


def _sqlite_stamps(micros: np.ndarray) -> list:
    """What Feast hands SQLite for each row: a naive UTC datetime, passed through the adapter Feast registers
    for datetimes (applied here once per distinct time rather than once per value)."""
    unique, inverse = np.unique(micros, return_inverse=True)
    stamps = pa.array(unique, pa.timestamp("us")).to_pylist()
    adapt = sqlite3.adapters.get((dt.datetime, sqlite3.PrepareProtocol))
    if adapt is not None:
        stamps = [adapt(s) for s in stamps]
    return [stamps[i] for i in inverse.tolist()]


def _write_sqlite(store: FeatureStore, online_store, view: FeatureView, rows: EncodedRows) -> None:
    from feast.infra.online_stores.sqlite import _quote_id, _table_id

    config = store.config
    if config.online_store.vector_enabled:
        raise UnsupportedForFastWrite("vector-enabled SQLite store")
    conn = online_store._get_conn(config)
    table = _table_id(config.project, view, config.registry.enable_online_feature_view_versioning)
    columns = {r[1] for r in conn.execute(f"PRAGMA table_info({_quote_id(table)})")}
    if columns != SQLITE_COLUMNS:  # e.g. value_num: Feast would compute it per value
        raise UnsupportedForFastWrite(f"SQLite table {table} has columns {sorted(columns)}")
    upsert = (
        f"INSERT INTO {_quote_id(table)} (entity_key, feature_name, value, value_text, event_ts, created_ts) "
        f"VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(entity_key, feature_name) DO UPDATE SET value = excluded.value, "
        f"value_text = excluded.value_text, event_ts = excluded.event_ts, created_ts = excluded.created_ts;"
    )
    event_ts = _sqlite_stamps(rows.event_us)
    created_ts = _sqlite_stamps(rows.created_us) if rows.created_us is not None else [None] * len(rows.keys)
    names = sorted(rows.values)
    values = [rows.values[n] for n in names]
    texts = [rows.texts[n] for n in names]
    # In primary-key order: each insert lands next to the previous one in the B-trees (several times faster
    # than Feast's order on a large table); the stored rows are the same.
    order = sorted(range(len(rows.keys)), key=rows.keys.__getitem__)
    params = (
        (rows.keys[i], name, values[j][i], texts[j][i], event_ts[i], created_ts[i])
        for i in order
        for j, name in enumerate(names)
    )
    with conn:
        conn.executemany(upsert, params)


def _timestamp_bytes(micros: np.ndarray) -> list[bytes]:
    """Serialized ``google.protobuf.Timestamp`` per row, built as Feast builds it (``FromDatetime``)."""
    from google.protobuf.timestamp_pb2 import Timestamp

    unique, inverse = np.unique(micros, return_inverse=True)
    encoded = []
    for stamp in pa.array(unique, pa.timestamp("us", tz="UTC")).to_pylist():
        ts = Timestamp()
        ts.FromDatetime(stamp)
        encoded.append(ts.SerializeToString())
    return [encoded[i] for i in inverse.tolist()]


def _write_redis(store: FeatureStore, online_store, view: FeatureView, rows: EncodedRows) -> None:
    from feast.infra.online_stores.helpers import _mmh3
    from feast.infra.online_stores.redis import _versioned_fv_name

    config = store.config.online_store
    client = online_store._get_client(config)
    name = _versioned_fv_name(view, store.config)
    ts_key = f"_ts:{name}"
    fields = {f: _mmh3(f"{name}:{f}") for f in rows.values}
    project = store.config.project.encode("utf-8")
    keys = [k + project for k in rows.keys]
    stamps = _timestamp_bytes(rows.event_us)
    new_nanos = rows.event_us.astype(np.int64) * 1000
    for lo in range(0, len(keys), REDIS_CHUNK):
        chunk = range(lo, min(lo + REDIS_CHUNK, len(keys)))
        write = np.ones(len(chunk), bool)
        with client.pipeline(transaction=False) as pipe:
            if not config.skip_dedup:
                for i in chunk:
                    pipe.hmget(keys[i], ts_key)
                previous = pipe.execute()
                stored = _stored_nanos(previous)
                write = (stored == 0) | (new_nanos[lo : lo + len(chunk)] > stored)
            for i in np.flatnonzero(write).tolist():
                i += lo
                mapping = {ts_key: stamps[i], **{fields[f]: v[i] for f, v in rows.values.items()}}
                pipe.hset(keys[i], mapping=mapping)
                if config.key_ttl_seconds:
                    pipe.expire(name=keys[i], time=config.key_ttl_seconds)
            pipe.execute()


def _stored_nanos(replies: list) -> np.ndarray:
    """Stored ``_ts`` per entity in nanoseconds (0 when absent), as Feast's dedup reads it."""
    from google.protobuf.timestamp_pb2 import Timestamp

    nanos = np.zeros(len(replies), np.int64)
    for i, (raw,) in enumerate(replies):
        if raw:
            ts = Timestamp()
            ts.ParseFromString(raw)
            nanos[i] = ts.seconds * 1_000_000_000 + ts.nanos
    return nanos


def write_rows(store: FeatureStore, view: FeatureView, table: pa.Table) -> int:
    """Write ``table`` to ``view``'s online storage exactly as Feast's ``online_write_batch`` would."""
    from feast.infra.online_stores.redis import RedisOnlineStore
    from feast.infra.online_stores.sqlite import SqliteOnlineStore

    if view.batch_source.field_mapping:
        raise UnsupportedForFastWrite(f"view {view.name!r} maps source fields")
    online_store = store._get_provider().online_store
    if not isinstance(online_store, SqliteOnlineStore | RedisOnlineStore):
        raise UnsupportedForFastWrite(f"online store {type(online_store).__name__}")
    if table.num_rows == 0:
        return 0
    rows = encode_rows(store, view, table)
    if len(set(rows.keys)) != len(rows.keys):  # Feast orders repeated entities by time within a batch
        raise UnsupportedForFastWrite(f"rows for view {view.name!r} repeat an entity")
    writer = _write_sqlite if isinstance(online_store, SqliteOnlineStore) else _write_redis
    writer(store, online_store, view, rows)
    return table.num_rows


def latest_rows(view: FeatureView, start: dt.datetime, end: dt.datetime) -> pa.Table:
    """The rows Feast's local engine materializes: source rows with ``start <= ts <= end``, the latest per entity
    by (event timestamp, created timestamp)."""
    source = view.batch_source
    if not isinstance(source, FileSource):
        raise UnsupportedForFastWrite(f"view {view.name!r} reads a {type(source).__name__}")
    join_key = _join_key(view)
    ts, created = source.timestamp_field, source.created_timestamp_column
    columns = [join_key, *(f.name for f in view.features), ts, *([created] if created else [])]
    files = sorted(glob.glob(source.path))
    if not files:
        return pa.table({c: [] for c in columns})
    rows = ds.dataset(files, format="parquet").to_table(
        columns=columns,
        filter=(ds.field(ts) >= pa.scalar(start, pa.timestamp("us", tz="UTC")))
        & (ds.field(ts) <= pa.scalar(end, pa.timestamp("us", tz="UTC"))),
    )
    if rows.num_rows == 0:
        return rows
    keys = rows.column(join_key).to_numpy().astype(np.int64)
    order_keys = [_micros(rows.column(ts))]
    if created:
        order_keys.insert(0, _micros(rows.column(created)))
    order = np.lexsort([*order_keys, keys])  # by key, then ts, then created ts (last = latest)
    last = np.append(keys[order][1:] != keys[order][:-1], True)
    return rows.take(pa.array(order[last]))


def _fast_or_feast(
    what: str, view: FeatureView, fast: Callable[[], int], feast: Callable[[], object]
) -> int | None:
    """Run the fast write; on any failure run Feast's own. Returns the rows the fast path wrote, None if Feast wrote."""
    try:
        return fast()
    except UnsupportedForFastWrite as why:  # a case the fast path knowingly leaves to Feast
        log.info("%s %s through Feast (%s)", what, view.name, why)
    except Exception as why:  # noqa: BLE001  the fast path broke (e.g. a Feast upgrade moved an internal)
        reason = f"{type(why).__name__}: {why}"
        if reason not in _warned:  # once per process and reason, not once per view and day
            _warned.add(reason)
            log.warning(
                "the fast online writer failed (%s); writing through Feast's own writer instead", reason
            )
        log.info("%s %s through Feast (%s)", what, view.name, reason)
    feast()
    return None


def push_views(store: FeatureStore, push_source: str) -> list[FeatureView]:
    """The feature views fed by ``push_source``."""
    return [
        v
        for v in store.list_feature_views()
        if v.stream_source is not None and v.stream_source.name == push_source
    ]


def materialize(store: FeatureStore, view_names: list[str], start: dt.datetime, end: dt.datetime) -> dict:
    """``store.materialize(start, end, view_names)``, fast; returns the rows written per view (None: by Feast)."""
    written = {}
    for name in view_names:
        view = store.get_feature_view(name)
        written[name] = _fast_or_feast(
            "materialize",
            view,
            lambda view=view: write_rows(store, view, latest_rows(view, start, end)),
            lambda name=name: store.materialize(start, end, [name]),
        )
        if written[name] is not None:  # Feast's materialize records its own interval
            store.registry.apply_materialization(view, store.project, start, end)
    return written


def push(
    store: FeatureStore, push_source: str, table: pa.Table, views: list[FeatureView] | None = None
) -> int:
    """``store.push(push_source, table, to=PushMode.ONLINE)``, fast, for every view fed by ``push_source``.

    ``views``: those views, resolved once by a caller that pushes many times (each registry lookup parses the
    views' protos again: ~9 ms a call on a 2-core machine)."""
    views = views if views is not None else push_views(store, push_source)
    if not views:
        raise ValueError(f"no feature view reads push source {push_source!r}")
    for view in views:
        check_rows(view, table)
        _fast_or_feast(
            "push to",
            view,
            lambda view=view: write_rows(store, view, table),
            lambda view=view: store.write_to_online_store(view.name, table.to_pandas()),
        )
    return table.num_rows
