"""Ad attributes an event's list entry carries (category, advertiser), from the newest ads snapshot.

The daily table joins each event with its day's accepted ads snapshot; live events arrive before their day is
ingested, so the collector reads the newest snapshot there is: the offline (accepted) partition of the newest
ingested day, or a newer raw snapshot already landed for today (ads created today). An ad it does not know is
looked up again after a reload (at most every ``reload_s``), then refused as ``unknown_ad``.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from features.feature_repo.offline import partition_days, read_partition
from gemflow.workspace import Workspace

log = logging.getLogger(__name__)


class AdLookup:
    def __init__(self, ws: Workspace, reload_s: float = 5.0):
        self.ws, self.reload_s = ws, reload_s
        self._lock = threading.Lock()
        self._loaded_at = -float("inf")
        empty = np.empty(0, np.int64)
        self._table = (empty, empty, empty)  # ad ids (sorted), category ids, advertiser ids: swapped as one
        self.snapshot = ""
        self.reload()

    def reload(self) -> None:
        offline = partition_days(self.ws, "offline", "ads")
        raw = partition_days(self.ws, "raw", "ads")
        newest_offline = offline[-1] if offline else None
        newest_raw = raw[-1] if raw else None
        if newest_raw is not None and (newest_offline is None or newest_raw > newest_offline):
            folder = self.ws.raw("ads", newest_raw)
        elif newest_offline is not None:
            folder = self.ws.offline("ads", newest_offline)
        else:
            self._loaded_at = time.monotonic()
            return
        table = read_partition(folder, ["ad_id", "advertiser_id", "category_id"])
        ids = table.column("ad_id").to_numpy().astype(np.int64)
        order = np.argsort(ids, kind="stable")
        with self._lock:
            self._table = (
                ids[order],
                table.column("category_id").to_numpy().astype(np.int64)[order],
                table.column("advertiser_id").to_numpy().astype(np.int64)[order],
            )
            self.snapshot = str(folder)
            self._loaded_at = time.monotonic()
        log.info("events: %d ads from %s", len(ids), folder)

    def find(self, ad_id: int) -> tuple[int, int] | None:
        """(category_id, advertiser_id) of ``ad_id``, or None when no snapshot has it."""
        found = self._find(ad_id)
        if found is None and time.monotonic() - self._loaded_at >= self.reload_s:
            self.reload()
            found = self._find(ad_id)
        return found

    def _find(self, ad_id: int) -> tuple[int, int] | None:
        ids, category, advertiser = self._table
        i = int(np.searchsorted(ids, ad_id))
        if i < len(ids) and ids[i] == ad_id:
            return int(category[i]), int(advertiser[i])
        return None
