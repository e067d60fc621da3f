"""Online reads of a feature service for a few entities, without Feast's response assembly.

``FeatureStore.get_online_features(service, rows).to_dict()`` for one user of the serving service (three views,
SQLite) costs ~0.6 ms of CPU on a 2-core AMD EPYC, ~0.1 ms of it in the store: the rest resolves the request,
builds Feast's response protobuf and turns it back into Python lists, on every request of the ranker. A
``ServiceReader`` resolves the service once and then makes only the calls Feast itself makes per view: the provider's
online store's ``online_read`` (same store, same connection), values converted by Feast's own
``feast_value_type_to_python_type``: ~0.27 ms. It returns what ``to_dict()`` returns (the join key column, then
feature -> one value per entity, None where absent). The service is resolved at construction: a service
re-applied with other features is read as such by a new reader (the server's next start).

Services this does not reproduce exactly (on-demand views, aliased projections, views keyed by different or
several entities) raise ``UnsupportedForFastRead`` at construction; ``online_reader`` then reads through Feast.
``tests/features/test_online_read.py`` compares both reads on SQLite and Redis.
"""

from __future__ import annotations

import datetime as dt
import logging
import sqlite3
from collections.abc import Callable, Sequence

from feast import FeatureStore
from feast.protos.feast.types.EntityKey_pb2 import EntityKey
from feast.type_map import feast_value_type_to_python_type, python_values_to_proto_values

log = logging.getLogger(__name__)
Reader = Callable[[Sequence], tuple[dict[str, list], dt.datetime | None]]


class UnsupportedForFastRead(ValueError):
    """A feature service whose online read ``ServiceReader`` does not reproduce (read it through Feast)."""


class ServiceReader:
    """``reader.read(ids)`` == ``store.get_online_features(features=service, entity_rows=...).to_dict()``."""

    def __init__(self, store: FeatureStore, service_name: str):
        service = store.get_feature_service(service_name)
        if service.feature_view_projections == [] or getattr(service, "precompute_online", False):
            raise UnsupportedForFastRead(f"feature service {service_name!r} has no plain feature views")
        self.views = []  # (FeatureView, [feature names])
        entities = set()
        for projection in service.feature_view_projections:
            if projection.name_alias or projection.join_key_map:
                raise UnsupportedForFastRead(f"view {projection.name!r} is aliased in {service_name!r}")
            try:
                view = store.get_feature_view(projection.name)
            except Exception as err:  # noqa: BLE001  an on-demand or stream view: Feast's path handles it
                raise UnsupportedForFastRead(
                    f"{projection.name!r} is not a plain feature view ({err})"
                ) from err
            if len(view.entities) != 1:
                raise UnsupportedForFastRead(f"view {view.name!r} is keyed by {len(view.entities)} entities")
            entities.add(view.entities[0])
            self.views.append((view, [f.name for f in projection.features]))
        if len(entities) != 1:
            raise UnsupportedForFastRead(f"the views of {service_name!r} are keyed by {sorted(entities)}")
        entity = store.get_entity(entities.pop())
        self.join_key, self.key_type = entity.join_key, entity.value_type
        names = [name for _, features in self.views for name in features]
        if len(set(names)) != len(names) or self.join_key in names:
            raise UnsupportedForFastRead(f"feature names repeat across the views of {service_name!r}")
        self.config = store.config
        self.online_store = store._get_provider().online_store  # the one Feast reads through (its connection)

    def read(self, entity_ids: Sequence) -> dict[str, list]:
        """The join key column, then feature -> one Python value per entity (None where the store has none)."""
        return self.read_with_time(entity_ids)[0]

    def read_with_time(self, entity_ids: Sequence) -> tuple[dict[str, list], dt.datetime | None]:
        """``read``, and the newest event timestamp of the rows it found (UTC; None when none was found)."""
        values = python_values_to_proto_values(list(entity_ids), self.key_type)
        keys = [EntityKey(join_keys=[self.join_key], entity_values=[v]) for v in values]
        out: dict[str, list] = {self.join_key: list(entity_ids)}
        stamps: list[dt.datetime] = []
        for view, features in self.views:
            # a copy: Redis's online_read appends its internal fields (``_ts:<view>``) to the list it is given
            rows = self.online_store.online_read(self.config, view, keys, list(features))
            for name in features:
                out[name] = [_value(row, name) for _, row in rows]
            stamps += [ts for ts, row in rows if ts is not None and row]
        return out, max(map(_utc, stamps), default=None)


def online_reader(store: FeatureStore, service_name: str, join_key: str) -> Reader:
    """``ids -> (to_dict()'s columns, the newest event time in whole seconds, as Feast's response has it)``:
    through a ``ServiceReader``, or through Feast's ``get_online_features`` for a service it does not reproduce
    or where building one fails (it uses the provider's online store, a Feast internal); logged once, here."""
    try:
        reader = ServiceReader(store, service_name)
    except UnsupportedForFastRead as why:
        log.info("reading %s through Feast's get_online_features (%s)", service_name, why)
    except Exception as why:  # noqa: BLE001  a Feast internal it leans on moved (an upgrade): cost speed, not reads
        log.warning("the fast online reader failed (%s: %s); reading %s through Feast's get_online_features",
                    type(why).__name__, why, service_name)  # fmt: skip
    else:

        def fast(ids: Sequence) -> tuple[dict[str, list], dt.datetime | None]:
            columns, newest = reader.read_with_time(ids)
            return columns, None if newest is None else newest.replace(microsecond=0)

        return fast
    service = store.get_feature_service(service_name)

    def through_feast(ids: Sequence) -> tuple[dict[str, list], dt.datetime | None]:
        rows = [{join_key: i} for i in ids]
        columns = store.get_online_features(features=service, entity_rows=rows).to_dict(
            include_event_timestamps=True
        )
        seconds = max(
            (t for name, col in columns.items() if name.endswith("__ts") for t in col if t), default=0
        )
        values = {name: col for name, col in columns.items() if not name.endswith("__ts")}
        return values, dt.datetime.fromtimestamp(seconds, dt.UTC) if seconds else None

    return through_feast


def sqlite_connection(store: FeatureStore) -> sqlite3.Connection | None:
    """The one connection Feast's SQLite online store reads through (a Feast internal, as ``ServiceReader``'s
    online store), or None for another online store."""
    if getattr(store.config.online_store, "type", "") != "sqlite":
        return None
    online = store._get_provider().online_store
    get = getattr(online, "_get_conn", None)
    return None if get is None else get(store.config)


def _utc(ts: dt.datetime) -> dt.datetime:
    """Stores hand back naive UTC (SQLite) or aware timestamps; Feast reads naive ones as UTC."""
    return ts.replace(tzinfo=dt.UTC) if ts.tzinfo is None else ts.astimezone(dt.UTC)


def _value(row: dict | None, name: str):
    value = None if row is None else row.get(name)
    return None if value is None else feast_value_type_to_python_type(value)
