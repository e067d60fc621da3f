"""The served ranker's raw id -> model row mapping: its bundle's vocabularies (``features.vocabulary``), the same
lookup training and the embedding refresh apply. Requests, the online store and the ad table speak raw ids;
only the model's embedding tables speak rows. A model trained before vocabularies uses its ids as rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from features.vocabulary import Vocabulary


@dataclass(frozen=True)
class IdRows:
    user: Vocabulary | None = None
    ad: Vocabulary | None = None

    @classmethod
    def of(cls, vocabularies: dict[str, Vocabulary] | None) -> IdRows:
        v = vocabularies or {}
        return cls(v.get("user_id"), v.get("ad_id"))

    def user_row(self, raw: int) -> tuple[int, bool]:
        """(row of the user table, whether the model knows the user); unknown -> the OOV row (-1)."""
        if self.user is None:
            return raw, True
        rows, known = self.user.lookup(np.array([raw], np.int64))
        return int(rows[0]), bool(known[0])

    def ad_rows(self, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows of the ad table, known mask) for raw ad ids; unknown -> the OOV row (-1)."""
        raw = np.asarray(raw, np.int64)
        if self.ad is None:
            return raw, np.ones(raw.shape, bool)
        return self.ad.lookup(raw)
