"""The recent-event lists one writer last wrote, kept so that its next merge reads only their bytes, not their values.

The live collector merges every event into its user's online list: read the stored list, merge, write. Most of
that read is Feast decoding every stored value back into Python (~50 µs a user at 64 events). ``ListCache`` keeps,
per user, the long-form events of the list this process last wrote and the stored bytes of the list values
(``LIST_COLUMNS``, what a merge reads). Before a merge it selects those values' bytes and the row's timestamp from
Feast's SQLite table (one query, nothing decoded) and takes its own copy for every user whose stored values are
byte-for-byte the ones it wrote; any other user (another writer got there: the daily ingest's push, a materialize)
is read through Feast as before. Equal bytes are equal values, so the merge sees exactly what Feast's read would
return: ``tests/features/test_list_cache.py`` merges with and without the cache, with a daily push in between.

Only Feast's embedded SQLite store (the collector's default); another store has no cache (``ListCache.of``).
"""

from __future__ import annotations

import sqlite3

import numpy as np
import pandas as pd
import pyarrow as pa
from feast import FeatureStore, FeatureView

from features.feature_repo.encoding import encode_values, entity_keys

ID_CHUNK = 5000  # entity keys per query (SQLite caps bound parameters)
MAX_USERS = 20_000  # users kept (~7 kB each at 64 events: ~150 MB); beyond, the cache starts over (misses cost a read)


class ListCache:
    def __init__(self, store: FeatureStore, view: FeatureView, conn: sqlite3.Connection, list_columns):
        from feast.infra.online_stores.sqlite import _quote_id, _table_id

        config = store.config
        self.view, self.conn, self.columns = view, conn, tuple(list_columns)
        self.key_version = config.entity_key_serialization_version
        self.dtypes = {f.name: f.dtype for f in view.features}
        table = _table_id(config.project, view, config.registry.enable_online_feature_view_versioning)
        self._select = (
            f"SELECT entity_key, feature_name, value, event_ts FROM {_quote_id(table)} "
            f"WHERE feature_name IN ({','.join('?' * len(self.columns))}) AND entity_key IN "
        )
        self.written: dict[int, tuple[tuple[bytes, ...], np.ndarray]] = {}  # user -> (values, long-form rows)

    @classmethod
    def of(cls, store: FeatureStore, view: FeatureView, list_columns) -> ListCache | None:
        from features.feature_repo.online_read import sqlite_connection

        conn = sqlite_connection(store)
        return None if conn is None else cls(store, view, conn, list_columns)

    def lookup(self, users: np.ndarray, event_columns) -> tuple[pd.DataFrame, dict[int, int], np.ndarray]:
        """(the cached lists of the users whose stored values are still this writer's, long form; their rows'
        timestamps in µs, as Feast's read returns them; the users to read through Feast)."""
        from features.feature_repo.online_read import _utc
        from features.recent_events import _micros

        hits, stamps, misses = [], {}, []
        keys = entity_keys(self.view.entity_columns[0].name, users, self.key_version)
        stored: dict[bytes, dict[str, bytes]] = {}
        stored_ts: dict[bytes, object] = {}
        for lo in range(0, len(keys), ID_CHUNK):
            chunk = keys[lo : lo + ID_CHUNK]
            for key, name, value, ts in self.conn.execute(
                self._select + f"({','.join('?' * len(chunk))})", (*self.columns, *chunk)
            ):
                stored.setdefault(key, {})[name] = value
                stored_ts[key] = ts
        for user, key in zip(users.tolist(), keys, strict=True):
            mine = self.written.get(user)
            values = stored.get(key)
            if (
                mine is not None
                and values is not None
                and mine[0] == tuple(values.get(c) for c in self.columns)
            ):
                hits.append(mine[1])
                stamps[user] = _micros(_utc(stored_ts[key]))
            else:
                misses.append(user)
        rows = np.concatenate(hits) if hits else np.empty((0, len(event_columns)), np.int64)
        return pd.DataFrame(rows, columns=list(event_columns)), stamps, np.array(misses, np.int64)

    def remember(self, table: pa.Table, merged: pd.DataFrame) -> None:
        """After a write of ``table`` (view rows) built from ``merged`` (long form, sorted by user)."""
        encoded = [encode_values(table.column(c), self.dtypes[c], c) for c in self.columns]
        rows = merged.to_numpy(np.int64)
        users = table.column(self.view.entity_columns[0].name).to_numpy()
        bounds = np.searchsorted(rows[:, 0], users, side="left").tolist() + [len(rows)]
        if len(self.written) + len(users) > MAX_USERS:
            self.written.clear()
        for i, user in enumerate(users.tolist()):
            self.written[user] = (tuple(v[i] for v in encoded), rows[bounds[i] : bounds[i + 1]].copy())
