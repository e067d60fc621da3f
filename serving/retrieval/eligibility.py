"""Which ads a request may be shown: paused ads, the request's surface, advertiser exclusions.

Held as per-ad arrays aligned with the index's rows, so a request's filter is one boolean mask the search takes
as its FAISS ``IDSelector`` (applied inside the search: excluded ads are never candidates, nothing is
over-fetched and dropped). The per-surface masks (unpaused and allowed there) are computed once per catalog.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from features.schema import SURFACES


class FilterError(ValueError):
    """A filter the catalog cannot apply (unknown surface): a client mistake, answered 4xx."""


@dataclass(frozen=True)
class AdFilter:
    surface: str | None = None  # None: every surface
    exclude_advertisers: tuple[int, ...] = ()


@dataclass
class AdEligibility:
    """Per index row: ``paused`` (bool), ``surfaces`` (bit i = may show on SURFACES[i]), ``advertiser`` (int64)."""

    paused: np.ndarray
    surfaces: np.ndarray
    advertiser: np.ndarray
    _by_surface: dict[str | None, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        n = len(self.paused)
        if len(self.surfaces) != n or len(self.advertiser) != n:
            raise ValueError("paused, surfaces and advertiser must have one entry per ad")
        live = ~np.asarray(self.paused, bool)
        self._by_surface[None] = live
        for i, name in enumerate(SURFACES):
            self._by_surface[name] = live & ((np.asarray(self.surfaces) >> i) & 1).astype(bool)

    @classmethod
    def everything(cls, n: int) -> AdEligibility:
        """Every ad live on every surface, no advertiser known (a catalog without serving attributes)."""
        return cls(
            np.zeros(n, bool), np.full(n, (1 << len(SURFACES)) - 1, np.int64), np.full(n, -1, np.int64)
        )

    def __len__(self) -> int:
        return len(self.paused)

    def mask(self, flt: AdFilter) -> np.ndarray:
        """(n,) bool: the ads ``flt`` allows (a shared array when nothing is excluded: read it, never write it)."""
        if flt.surface not in self._by_surface:
            raise FilterError(f"surface {flt.surface!r} is not one of {list(SURFACES)}")
        allowed = self._by_surface[flt.surface]
        if flt.exclude_advertisers:
            excluded = np.asarray(flt.exclude_advertisers, np.int64)
            allowed = allowed & ~np.isin(self.advertiser, excluded)
        return allowed


class OfflineEligibility:
    """Eligibility from the source tables' newest offline partitions: ``ad_serving`` (paused, surfaces: written by
    ingest from the ads source) and ``ad_attributes`` (advertiser). An ad neither table knows is live on every
    surface. ``key`` changes when either newest partition does: the server re-reads them then, the index stays."""

    TABLES = ("ad_serving", "ad_attributes")

    def __init__(self, ws):
        self.ws = ws

    def _newest(self, table: str):
        from features.feature_repo.offline import partition_days, partition_files

        days = partition_days(self.ws, "offline", table)
        return partition_files(self.ws.offline(table, days[-1])) if days else []

    def key(self) -> str:
        files = [f for t in self.TABLES for f in self._newest(t)]
        return ";".join(f"{f}@{f.stat().st_mtime_ns}" for f in files)

    def build(self, ad_ids: np.ndarray) -> AdEligibility:
        import pyarrow.parquet as pq

        elig = AdEligibility.everything(len(ad_ids))
        columns = {"ad_serving": ("ad_paused", "ad_surfaces"), "ad_attributes": ("ad_advertiser_id",)}
        for table, names in columns.items():
            files = self._newest(table)
            if not files:
                continue
            data = [pq.read_table(f, columns=["ad_id", *names]) for f in files]
            ids = np.concatenate([t.column("ad_id").to_numpy() for t in data]).astype(np.int64)
            order = np.argsort(ids, kind="stable")
            at = np.minimum(np.searchsorted(ids, ad_ids, sorter=order), max(len(ids) - 1, 0))
            found = (ids[order[at]] == ad_ids) if len(ids) else np.zeros(len(ad_ids), bool)
            rows = order[at][found]
            for name in names:
                values = np.concatenate([t.column(name).to_numpy(zero_copy_only=False) for t in data])[rows]
                if name == "ad_paused":
                    elig.paused[found] = values.astype(bool)
                elif name == "ad_surfaces":
                    elig.surfaces[found] = values.astype(np.int64)
                else:
                    elig.advertiser[found] = values.astype(np.int64)
        return AdEligibility(
            elig.paused, elig.surfaces, elig.advertiser
        )  # per-surface masks of the new values
