"""Every ad's user-independent query, computed once per ad-table snapshot and surface, gathered per request.

A candidate's token and the first target-aware block's projected query (``Ranker.candidate_queries``) depend on
the ad alone (its ids and dense features, both from the ad table) and on the request's surface. Computed for
every candidate of every request they were ~15% of scoring 1,000 candidates; here the rows of all ads of a
snapshot are computed by the first request that needs them (~3 ms for 6,000 ads) and a request gathers its
candidates' rows. The tables (2 x d_model floats per ad and surface: 3 MB for 6,000 ads at d_model 64) are built
while they fit ``max_bytes``; a surface whose table would not fit, and a request naming an ad outside the ad table,
take the per-request computation instead: same function, same results.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from models.architectures.ranker import CandidateQueries, Ranker
from serving import inputs as build


class CandidateCache:
    def __init__(self, ranker: Ranker, max_bytes: int):
        self.ranker, self.max_bytes = ranker, max_bytes
        self._arrays: build.AdArrays | None = None  # the snapshot the tables were computed from
        self._tables: dict[int, CandidateQueries] = {}  # surface -> rows of every ad id in [0, size)
        self._lock = threading.Lock()

    def queries(self, ads: build.AdArrays, surface: int, ad_ids: np.ndarray) -> CandidateQueries | None:
        """The rows of ``ad_ids`` (request order), or None where the cache does not cover them."""
        size = len(ads.advertiser)
        if size == 0 or ad_ids.size == 0 or ad_ids.min() < 0 or ad_ids.max() >= size:
            return None
        rows = self.table(ads, surface)
        return None if rows is None else rows.rows(torch.from_numpy(ad_ids))

    def table(self, ads: build.AdArrays, surface: int) -> CandidateQueries | None:
        """All ads' rows for ``surface`` (computed once per snapshot; a refresh drops the old ones), or None when
        they would not fit ``max_bytes``."""
        with self._lock:  # the scoring workers share it: one computes, the other waits for its result
            if self._arrays is not ads:
                self._arrays, self._tables = ads, {}
            rows = self._tables.get(surface)
            if rows is None:
                if self.held_bytes() + self.table_bytes(len(ads.advertiser)) > self.max_bytes:
                    return None
                every_ad = np.arange(len(ads.advertiser), dtype=np.int64)
                cands, _ = build.candidates(every_ad, surface, ads)
                with torch.inference_mode():
                    rows = self.ranker.candidate_queries(cands, project=True)
                self._tables[surface] = rows
            return rows

    def table_bytes(self, num_ads: int) -> int:
        """One surface's table: a token, and the first block's query where the ranker has target-aware blocks."""
        per_ad = 2 if self.ranker.cfg.pooling == "target" and len(self.ranker.blocks) else 1
        return num_ads * per_ad * self.ranker.cfg.d_model * 4

    def held_bytes(self) -> int:
        return sum(
            t.nbytes
            for rows in self._tables.values()
            for t in (rows.token, rows.first_query)
            if t is not None
        )
