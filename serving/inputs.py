"""Online features -> the ranker's tensors, with exactly the transforms training applies (``models.training.batch_builder``).

- recent events: the online store's last events, oldest first, those older than ``fresh_cutoff(request_ts,
  ranker.fresh_delay_s)`` (what training reads: ``TrainingSet.events_at``), cut to ``ranker.recent_events``;
  time gaps are bucketed against the request time (``time_bucket(request_ts - ts)``, as ``gap_to="request"``);
  an event's advertiser comes from the ad table; its surface from ``recent_surfaces`` when the view has it,
  else ``MISSING_SURFACE`` (counted: the ``user_recent_events`` view does not carry surfaces yet);
- profile: gender / country ids (missing -> -1, the OOV row), age through ``models.architectures.transforms.normalize_age``
  (missing -> 0 years, as in training);
- candidates: ids from the ad table (unknown ad -> -1, the OOV row), the request's surface, dense features
  through the trained ``DenseSpec`` (``apply`` itself, computed once per ad-table snapshot);
- cached user tokens: the embedding split into ``num_user_tokens`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from features.schema import SURFACE_ID
from models.architectures.transforms import fresh_cutoff, normalize_age, time_bucket
from models.training.batch import Candidates, Events, Profile
from models.training.dense import DenseSpec
from serving.ad_table import AdSnapshot
from serving.id_rows import IdRows
from serving.user_features import UserFeatures

MISSING_SURFACE = SURFACE_ID["feed"]


@dataclass
class AdArrays:
    """Per-snapshot, per-model arrays indexed by ad position (``AdSnapshot.positions``; built once per refresh,
    not per request). ``rows``: each position's row of the model's ad table (``id_rows``: its vocabulary)."""

    snapshot: AdSnapshot
    dense: np.ndarray  # (size, F) float32, normalized
    advertiser: np.ndarray  # (size,) int64, -1 unknown
    category: np.ndarray  # (size,) int64, -1 unknown
    missing_columns: list[str]  # trained dense columns the ad table does not hold
    default: np.ndarray  # (F,) the dense row of an ad without values (training's NaN handling)
    rows: np.ndarray | None = None  # (size,) int64 model rows, -1 = the OOV row; None: the positions
    id_rows: IdRows = IdRows()

    @classmethod
    def build(cls, snap: AdSnapshot, spec: DenseSpec, id_rows: IdRows | None = None) -> AdArrays:
        id_rows = id_rows or IdRows()
        size = len(snap.known)
        frame, missing = {}, []
        for col in spec.columns:
            src = col if col in snap.columns else f"ad_{col}"
            if src in snap.columns:
                frame[col] = snap.columns[src]
            else:
                frame[col] = np.full(size, np.nan)
                missing.append(col)
        dense = (
            spec.apply(pd.DataFrame(frame, index=pd.RangeIndex(size)))
            if size
            else np.zeros((0, len(spec.columns)), np.float32)
        )

        def ids(name: str) -> np.ndarray:
            col = snap.columns.get(name)
            if col is None:
                return np.full(size, -1, np.int64)
            return np.where(snap.known & ~np.isnan(col), np.nan_to_num(col, nan=-1), -1).astype(np.int64)

        adv, cat = ids("ad_advertiser_id"), ids("ad_category_id")
        # positions are the model's rows already when ids are small and the model has no vocabulary
        rows = None if id_rows.ad is None and snap.ids is None else id_rows.ad_rows(snap.raw_ids())[0]
        return cls(snap, dense.astype(np.float32), adv, cat, missing, default_dense_row(spec), rows, id_rows)

    def positions(self, raw_ad_ids: np.ndarray) -> np.ndarray:
        return self.snapshot.positions(raw_ad_ids)

    def take(self, ad_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """dense (N, F), advertiser (N,), category (N,), known (N,) for positions ``ad_ids`` (unknown ->
        defaults)."""
        size = len(self.advertiser)
        inside = (ad_ids >= 0) & (ad_ids < size)
        idx = np.where(inside, ad_ids, 0)
        known = inside & self.snapshot.known[idx] if size else np.zeros(len(ad_ids), bool)
        if size:
            dense = np.where(known[:, None], self.dense[idx], self.default)
            adv = np.where(known, self.advertiser[idx], -1)
            cat = np.where(known, self.category[idx], -1)
        else:
            dense = np.broadcast_to(self.default, (len(ad_ids), len(self.default)))
            adv = cat = np.full(len(ad_ids), -1, np.int64)
        return np.ascontiguousarray(dense, np.float32), adv, cat, known

    def unknown_count(self, ad_ids: np.ndarray) -> int:
        """How many of ``ad_ids`` the ad table does not know (``take``'s ``known``, counted without the rows)."""
        size = len(self.advertiser)
        if not size:
            return len(ad_ids)
        inside = (ad_ids >= 0) & (ad_ids < size)
        return int(len(ad_ids) - (inside & self.snapshot.known[np.where(inside, ad_ids, 0)]).sum())


def default_dense_row(spec: DenseSpec) -> np.ndarray:
    """What training's normalization gives an ad with no feature values (NaN -> 0 -> z-scored)."""
    if not spec.columns:
        return np.zeros(0, np.float32)
    return spec.apply(pd.DataFrame({c: [np.nan] for c in spec.columns}))[0]


def fresh_window(
    rec: dict[str, np.ndarray], request_ts: float, max_events: int, delay_s: int | None
) -> slice:
    """The stored list's events the ranker reads: the newest ``max_events`` of those older than ``fresh_cutoff``
    (``delay_s`` None: of the whole list). The list is in event-time order: the visible events are a prefix."""
    visible = len(rec["recent_ts"])
    if delay_s is not None:
        visible = int(np.searchsorted(rec["recent_ts"], fresh_cutoff(request_ts, delay_s), side="left"))
    return slice(max(0, visible - max_events), visible)


def recent_events(
    feats: UserFeatures | None,
    ads: AdArrays,
    request_ts: float,
    max_events: int,
    time_buckets: int,
    delay_s: int | None = None,
) -> tuple[Events, bool]:
    """(1 user) Events of the recent window, and whether surfaces had to be filled. ``delay_s``: the ranker's
    ``fresh_delay_s`` (None: the whole list)."""
    rec = feats.recent if feats is not None and feats.recent is not None else None
    if rec is None:
        z = torch.zeros(0, dtype=torch.int64)
        return Events(z, z, z, z, z, z, z, torch.tensor([0, 0])), False
    take = fresh_window(rec, request_ts, max_events, delay_s)
    ad = rec["recent_ad_ids"][take]
    ts = rec["recent_ts"][take]
    filled = "recent_surfaces" not in rec
    surface = np.full(len(ad), MISSING_SURFACE, np.int64) if filled else rec["recent_surfaces"][take]
    # the view carries no advertiser per event: the ad table knows each ad's advertiser
    if "recent_advertiser_ids" in rec:
        advertiser = rec["recent_advertiser_ids"][take]
    else:
        advertiser = ads.take(ads.positions(ad))[1]
    gap = time_bucket(np.int64(int(request_ts)) - ts, time_buckets)
    t = torch.from_numpy
    events = Events(
        ad_id=t(np.ascontiguousarray(ads.id_rows.ad_rows(ad)[0], np.int64)),
        action=t(rec["recent_actions"][take].copy()),
        surface=t(np.ascontiguousarray(surface)),
        category_id=t(rec["recent_category_ids"][take].copy()),
        advertiser_id=t(np.ascontiguousarray(advertiser, np.int64)),
        ts=t(ts.copy()),
        gap_bucket=t(gap),
        offsets=torch.tensor([0, len(ad)]),
    )
    return events, filled


def profile(user_id: int, feats: UserFeatures | None) -> Profile:
    age = feats.age if feats is not None and feats.age is not None else np.nan
    gender = feats.gender if feats is not None and feats.gender is not None else -1
    country = feats.country if feats is not None and feats.country is not None else -1
    return Profile(
        user_id=torch.tensor([user_id]),
        gender=torch.tensor([gender]),
        country=torch.tensor([country]),
        dense=torch.from_numpy(normalize_age(age)),
    )


def candidate_rows(raw_ids: np.ndarray, positions: np.ndarray, ads: AdArrays) -> np.ndarray:
    """The model's ad rows (-1 = its OOV row) of one request's candidates: gathered from the ad table's
    per-position rows (computed once per snapshot), looked up in the vocabulary only for ads the table lacks."""
    if ads.rows is None:
        return ads.id_rows.ad_rows(raw_ids)[0]
    inside = (positions >= 0) & (positions < len(ads.rows))
    rows = ads.rows[np.where(inside, positions, 0)] if len(ads.rows) else np.zeros(len(raw_ids), np.int64)
    if not inside.all():
        rows = rows.copy()
        rows[~inside] = ads.id_rows.ad_rows(raw_ids[~inside])[0]
    return rows


def candidates(
    ad_ids: np.ndarray, surface: int, ads: AdArrays, ad_rows: np.ndarray | None = None
) -> tuple[Candidates, int]:
    """Candidates (ad positions) of one request and how many were unknown to the ad table. ``ad_rows``: their
    rows of the model's ad table (from the raw ids, ``IdRows.ad_rows``); by default the ad table's."""
    dense, adv, cat, known = ads.take(ad_ids)
    n = len(ad_ids)
    if ad_rows is None and ads.rows is None:
        ad_rows = ad_ids
    elif ad_rows is None:  # positions outside the table (warm-up sizes) -> the OOV row
        inside = (ad_ids >= 0) & (ad_ids < len(ads.rows))
        ad_rows = np.where(inside, ads.rows[np.where(inside, ad_ids, 0)] if len(ads.rows) else -1, -1)
    cands = Candidates(
        ad_id=torch.from_numpy(np.ascontiguousarray(ad_rows, np.int64)),
        advertiser_id=torch.from_numpy(adv),
        category_id=torch.from_numpy(cat),
        surface=torch.full((n,), surface, dtype=torch.int64),
        dense=torch.from_numpy(dense),
        offsets=torch.tensor([0, n]),
    )
    return cands, int(n - known.sum())
