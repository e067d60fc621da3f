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
