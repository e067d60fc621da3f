"""The fixed world of a synthetic log (users, ads, their latent parameters) and the state carried across days.

``build_world`` draws what stays fixed over the generated days from the seed; ``initial_state`` the per-user
state (short-term interest, recent engagements, remembered advertisers) that each day's events advance. The
planted structure is described in ``features.sources.synthetic``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from features.schema import ADS_SCHEMA, GENDERS, SURFACES, TS, USERS_SCHEMA
from features.sources import writer

if TYPE_CHECKING:
    from features.sources.synthetic import SyntheticConfig

DAY_US = 86_400 * 1_000_000
REMEMBERED_ADVERTISERS = 4  # clicked / converted advertisers carried across days, per user
LATENT_DIM = 4


@dataclass
class World:
    """What does not change over the generated days: users, ads and their latent parameters."""

    theta: np.ndarray  # [U, K] long-term interest mixture
    theta_cdf: np.ndarray  # [U, K] its cumulative sums (last column exactly 1)
    surface_cdf: np.ndarray  # [U, S]
    activity: np.ndarray  # [U] mean 1
    user_vec: np.ndarray  # [U, LATENT_DIM]
    advertiser_vec: np.ndarray  # [num_advertisers, LATENT_DIM]
    ad_advertiser: np.ndarray  # [A] int32
    ad_quality: np.ndarray  # [A] float32
    ads_by_category: np.ndarray  # ad ids sorted by primary category
    category_start: np.ndarray  # [K] first index into ads_by_category
    category_count: np.ndarray  # [K]
    users: pa.Table
    ads: pa.Table


@dataclass
class State:
    """Carried from one day to the next; O(users)."""

    short_term: np.ndarray  # [U] current short-term category
    next_switch_s: np.ndarray  # [U] seconds since the first day's 00:00 of the next switch
    recent_category: np.ndarray  # [U, W] categories of the last W base events, -1 where not an engagement
    recent_advertiser: np.ndarray  # [U, W] same for advertisers
    clicked_advertisers: np.ndarray  # [U, REMEMBERED_ADVERTISERS], -1 = none
    converted_advertisers: np.ndarray  # [U, REMEMBERED_ADVERTISERS]
    next_event_id: int = 0


def build_world(cfg: SyntheticConfig) -> World:
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0]))
    n_users, n_cat = cfg.num_users, cfg.num_categories
    start_us = writer.day_bounds_us(cfg.start())[0]

    age = np.clip(np.round(rng.normal(34, 12, n_users)), 13, 80).astype(np.int16)
    gender = rng.choice(len(GENDERS), size=n_users, p=[0.05, 0.5, 0.45])
    country_weights = 1.0 / np.arange(1, cfg.num_countries + 1)
    country = rng.choice(cfg.num_countries, size=n_users, p=country_weights / country_weights.sum())
    signup_us = start_us - rng.integers(1, 1000, n_users) * DAY_US + rng.integers(0, DAY_US, n_users)

    # The profile tilts the interest prior: two categories per (age band, gender), one per country.
    band = np.searchsorted([25, 40, 60], age, side="right")
    group = band * len(GENDERS) + gender
    boost = np.zeros((n_users, n_cat))
    rows = np.arange(n_users)
    boost[rows, (group * 7) % n_cat] += cfg.profile_tie
    boost[rows, (group * 7 + 1) % n_cat] += cfg.profile_tie
    boost[rows, (country * 3 + 2) % n_cat] += cfg.profile_tie
    theta = rng.gamma(cfg.interest_concentration * (1.0 + boost)) + 1e-12
    theta /= theta.sum(axis=1, keepdims=True)
    surface_pref = rng.dirichlet(np.full(len(SURFACES), 1.0), size=n_users)

    if cfg.activity == "lognormal":
        activity = np.exp(cfg.activity_sigma * rng.standard_normal(n_users) - cfg.activity_sigma**2 / 2)
    else:
        activity = (rng.permutation(n_users) + 1.0) ** -cfg.zipf_exponent
        activity /= activity.mean()

    # Ads: advertisers have a home category; the first K ads cover every category once.
    home = rng.integers(0, n_cat, cfg.num_advertisers)
    advertiser = rng.integers(0, cfg.num_advertisers, cfg.num_ads).astype(np.int32)
    category = np.where(rng.random(cfg.num_ads) < 0.7, home[advertiser], rng.integers(0, n_cat, cfg.num_ads))
    category[:n_cat] = np.arange(n_cat)
    second = (category + rng.integers(1, max(n_cat, 2), cfg.num_ads)) % n_cat
    has_second = (rng.random(cfg.num_ads) < 0.3) & (second != category)
    quality = rng.beta(2.0, 2.0, cfg.num_ads).astype(np.float32)
    created_us = start_us - rng.integers(1, 180, cfg.num_ads) * DAY_US

    lengths = 1 + has_second.astype(np.int32)
    values = np.empty(lengths.sum(), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values[offsets[:-1]] = category
    values[offsets[:-1][has_second] + 1] = second[has_second]

    users = pa.Table.from_arrays(
        [
            pa.array(np.arange(n_users, dtype=np.int64)),
            pa.array(age),
            writer.strings(gender, GENDERS),
            pa.array(country.astype(np.int32)),
            pa.array(signup_us, TS),
        ],
        schema=USERS_SCHEMA,
    )
    ads = pa.Table.from_arrays(
        [
            pa.array(np.arange(cfg.num_ads, dtype=np.int64)),
            pa.array(advertiser.astype(np.int64)),
            pa.array(category.astype(np.int32)),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            pa.array(quality),
            pa.array(created_us, TS),
        ],
        schema=ADS_SCHEMA,
    )
    by_category = np.argsort(category, kind="stable")
    counts = np.bincount(category, minlength=n_cat)
    return World(
        theta=theta.astype(np.float32),
        theta_cdf=_cdf(theta),
        surface_cdf=_cdf(surface_pref),
        activity=activity,
        user_vec=(rng.standard_normal((n_users, LATENT_DIM)) / LATENT_DIM**0.25).astype(np.float32),
        advertiser_vec=(rng.standard_normal((cfg.num_advertisers, LATENT_DIM)) / LATENT_DIM**0.25).astype(
            np.float32
        ),
        ad_advertiser=advertiser,
        ad_quality=quality,
        ads_by_category=by_category,
        category_start=np.cumsum(counts) - counts,
        category_count=counts,
        users=users,
        ads=ads,
    )


def initial_state(cfg: SyntheticConfig, world: World) -> State:
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0, 1]))
    n, w = cfg.num_users, cfg.recent_window
    users = np.arange(n)
    return State(
        short_term=sample_rows(world.theta_cdf, users, rng),
        next_switch_s=rng.exponential(cfg.short_term_hours * 3600, n),
        recent_category=np.full((n, w), -1, dtype=np.int32),
        recent_advertiser=np.full((n, w), -1, dtype=np.int32),
        clicked_advertisers=np.full((n, REMEMBERED_ADVERTISERS), -1, dtype=np.int32),
        converted_advertisers=np.full((n, REMEMBERED_ADVERTISERS), -1, dtype=np.int32),
    )


def _cdf(weights: np.ndarray) -> np.ndarray:
    cdf = np.cumsum(weights / weights.sum(axis=1, keepdims=True), axis=1)
    cdf[:, -1] = 1.0
    return cdf


def sample_rows(cdf: np.ndarray, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One categorical draw per entry of ``rows`` from that row of ``cdf`` (a single searchsorted)."""
    if rows.size == 0:
        return np.zeros(0, dtype=np.int32)
    lo, hi = int(rows.min()), int(rows.max()) + 1
    block = cdf[lo:hi].astype(np.float64) + np.arange(hi - lo)[:, None]
    local = rows - lo
    index = np.searchsorted(block.ravel(), local + rng.random(rows.size), side="right")
    return np.clip(index - local * cdf.shape[1], 0, cdf.shape[1] - 1).astype(np.int32)


def roll(old: np.ndarray, values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per row, the last ``W`` items of (``old`` row ++ that row's ``values``); values are grouped by row."""
    n, w = old.shape
    new = np.empty_like(old)
    ends = np.cumsum(counts)
    rows = np.arange(n)
    for k in range(1, w + 1):
        kept = old[rows, np.clip(w - k + counts, 0, w - 1)]
        if values.size:
            new[:, w - k] = np.where(counts >= k, values[np.clip(ends - k, 0, values.size - 1)], kept)
        else:
            new[:, w - k] = kept
    return new
