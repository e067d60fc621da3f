"""Seeded synthetic ads event logs with planted structure that the later model stages must discover.

``generate(cfg, ws)`` writes ``cfg.days`` day partitions of the raw contract (``features.schema``): events
streamed per user chunk into ``ws.raw("events", day)/part-00000.parquet``, and full users/ads snapshots per day.
Same config -> byte-identical parquet. Memory is bounded by one user chunk; the state carried from one day to
the next is O(users) (a few small arrays per user), never O(events).

Planted structure (what the user model and the ranker can learn; all weights are ``SyntheticConfig`` fields):

- **Users** have a long-term interest mixture ``theta_u`` over the ad categories (Dirichlet with concentration
  ``interest_concentration``: small = focused users). Its prior is boosted (``profile_tie``) on two categories
  picked by (age band, gender) and one by country, so the profile predicts interests weakly.
- Each user also has a **short-term interest**: one category that switches at exponential times (mean
  ``short_term_hours``); a new one is drawn from ``theta_u`` half the time and uniformly otherwise (drift).
- **Activity** is heavy-tailed (lognormal with ``activity_sigma``, or Zipf with ``zipf_exponent``), so history
  lengths over the generated days span several orders of magnitude.
- **Ads** have an advertiser (each advertiser has a home category that 70% of its ads share), a primary
  category (+ a second one for 30%), and a quality in [0, 1] (Beta(2, 2)).
- **Base events** per user and day: a Poisson number (mean ``events_per_user_day`` x activity) at uniform times.
  A share ``impression_share`` are ad impressions, the rest organic actions (view 55%, like 20%, share 5%,
  comment 8%, hide 12%) on ads too. Organic engagements (view/like/share/comment) come from the short-term
  interest with probability ``short_term_share`` and from ``theta_u`` otherwise; hides hit uniform categories.
  Impressions are targeted: ``target_short_term`` from the short-term interest, ``target_long_term`` from
  ``theta_u``, the rest uniform. The ad is uniform within the chosen category; the surface comes from a
  per-user surface preference (Dirichlet).
- **Click label** of an impression of ad ``a`` (category ``c``, advertiser ``v``) on surface ``s``:
  ``logit = click_base + click_quality*(2*quality_a - 1) + click_long_term*clip(log(K*theta_u[c]), -3, 3)
  + click_recent_category*[c was engaged with in the user's last recent_window base events]
  + click_recent_advertiser*[v was engaged with in the last recent_window base events, or is among the
  user's last 4 clicked advertisers of previous days] + SURFACE_EFFECT[s]``.
  "Base events" are impressions and organic actions (not the click/conversion events); "engaged" means
  view/like/share/comment. The recent terms are the target-aware signal: a model that lets the candidate look
  up matching recent events can see them, a mean-pooled long history mostly cannot.
- **Conversion given click**: ``logit = conversion_base + conversion_affinity*<user_vec, advertiser_vec>
  + conversion_repeat*[v is among the user's last 4 converted advertisers of previous days]`` with 4-dim
  latent vectors (unit variance dot product), i.e. conversions depend on user-advertiser affinity.
- A positive impression is followed by a ``click`` event 1-30 s later and, when converted, a ``conversion``
  event 5-600 s after the click (same ad and surface; labels only on the impression). Times are clamped to
  the day, so partition D holds exactly the events of [D 00:00, D+1 00:00) UTC.

``event_id`` counts up from 0 across all days in (day, user, time) order. ``inject`` corrupts events with
``features.sources.defects.inject_defects`` and records what it did in ``_injected.json`` in the partition.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from features.schema import (
    ACTION_ID,
    ACTIONS,
    ADS_SCHEMA,
    DEFECTS,
    EVENTS_SCHEMA,
    GENDERS,
    SURFACES,
    TS,
    USERS_SCHEMA,
)
from features.sources import writer
from gemflow.config import save_config
from gemflow.workspace import Workspace

DAY_US = 86_400 * 1_000_000
SECOND_US = 1_000_000
# Click-logit offset per surface (feed, stories, reels, search, marketplace): intent is highest on search.
SURFACE_EFFECT = np.array([0.0, -0.3, 0.2, 0.6, 0.3])
ORGANIC_ACTIONS = ("view", "like", "share", "comment", "hide")
ORGANIC_PROBS = (0.55, 0.20, 0.05, 0.08, 0.12)
ENGAGING_ACTIONS = ("view", "like", "share", "comment")
REMEMBERED_ADVERTISERS = 4  # clicked / converted advertisers carried across days, per user
LATENT_DIM = 4


@dataclass
class SyntheticConfig:
    seed: int = 0
    num_users: int = 2_000
    num_ads: int = 1_000
    num_advertisers: int = 100
    num_categories: int = 20
    num_countries: int = 30
    start_date: str = "2026-01-01"
    days: int = 3
    events_per_user_day: float = 20.0  # mean base events (impressions + organic) per user and day
    activity: str = "lognormal"  # "lognormal" or "zipf": how activity is spread over users
    activity_sigma: float = 1.5
    zipf_exponent: float = 1.0
    max_events_per_user_day: int = 20_000
    interest_concentration: float = 0.3
    profile_tie: float = 3.0
    short_term_hours: float = 8.0
    short_term_share: float = 0.5
    impression_share: float = 0.5
    target_short_term: float = 0.15
    target_long_term: float = 0.35
    recent_window: int = 20
    click_base: float = -3.5
    click_quality: float = 1.0
    click_long_term: float = 0.4
    click_recent_category: float = 1.8
    click_recent_advertiser: float = 1.2
    conversion_base: float = -1.5
    conversion_affinity: float = 1.5
    conversion_repeat: float = 1.0
    users_per_chunk: int = 20_000

    def validate(self) -> None:
        positive = (
            "num_users",
            "num_ads",
            "num_advertisers",
            "num_categories",
            "num_countries",
            "days",
            "recent_window",
            "users_per_chunk",
            "max_events_per_user_day",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"SyntheticConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_ads < self.num_categories:
            raise ValueError(
                f"SyntheticConfig.num_ads ({self.num_ads}) must be >= num_categories "
                f"({self.num_categories}) so that every category has an ad"
            )
        if self.num_advertisers >= 2**31:
            raise ValueError("SyntheticConfig.num_advertisers must fit in int32")
        if self.activity not in ("lognormal", "zipf"):
            raise ValueError(f"SyntheticConfig.activity must be 'lognormal' or 'zipf', got {self.activity!r}")
        for name in ("short_term_share", "impression_share", "target_short_term", "target_long_term"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SyntheticConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.target_short_term + self.target_long_term > 1.0:
            raise ValueError("SyntheticConfig.target_short_term + target_long_term must be <= 1")
        if self.events_per_user_day < 0 or self.short_term_hours <= 0 or self.interest_concentration <= 0:
            raise ValueError(
                "SyntheticConfig: events_per_user_day >= 0, short_term_hours > 0 and "
                "interest_concentration > 0 are required"
            )
        self.start()

    def start(self) -> dt.date:
        try:
            return dt.date.fromisoformat(str(self.start_date))
        except ValueError as err:
            raise ValueError(
                f"SyntheticConfig.start_date {self.start_date!r} is not a date like 2026-01-31"
            ) from err


@dataclass
class _World:
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
class _State:
    """Carried from one day to the next; O(users)."""

    short_term: np.ndarray  # [U] current short-term category
    next_switch_s: np.ndarray  # [U] seconds since the first day's 00:00 of the next switch
    recent_category: np.ndarray  # [U, W] categories of the last W base events, -1 where not an engagement
    recent_advertiser: np.ndarray  # [U, W] same for advertisers
    clicked_advertisers: np.ndarray  # [U, REMEMBERED_ADVERTISERS], -1 = none
    converted_advertisers: np.ndarray  # [U, REMEMBERED_ADVERTISERS]
    next_event_id: int = 0


def generate(
    cfg: SyntheticConfig,
    ws: Workspace,
    inject: Mapping[str, float] | None = None,
    *,
    inject_days: Collection[dt.date] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Write ``cfg.days`` partitions into ``ws``; ``inject`` corrupts the events of ``inject_days`` (all days
    when None). Returns a summary (events per day, throughput, injected defect counts, where the run is recorded)."""
    cfg.validate()
    inject = _check_inject(inject)
    started = time.perf_counter()
    world = _build_world(cfg)
    state = _initial_state(cfg, world)
    ads_frame = world.ads.to_pandas() if inject else None
    n_chunks = -(-cfg.num_users // cfg.users_per_chunk)
    events_per_day: dict[str, int] = {}
    injected: dict[str, dict[str, int]] = {}

    bar = tqdm(total=cfg.days * n_chunks, unit="chunk", desc="synthetic events", disable=not progress)
    for day_index in range(cfg.days):
        day = cfg.start() + dt.timedelta(days=day_index)
        writer.write_snapshot(ws, "users", day, world.users)
        writer.write_snapshot(ws, "ads", day, world.ads)
        folder = writer.fresh_partition(ws, "events", day)
        corrupt = bool(inject) and (inject_days is None or day in inject_days)
        tables: list[pa.Table] = []
        written = 0
        with pq.ParquetWriter(folder / writer.EVENTS_FILE, EVENTS_SCHEMA) as out:
            for chunk in range(n_chunks):
                rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, day_index + 1, chunk]))
                users = slice(
                    chunk * cfg.users_per_chunk, min((chunk + 1) * cfg.users_per_chunk, cfg.num_users)
                )
                table = _simulate_chunk(cfg, world, state, users, day_index, day, rng)
                written += table.num_rows
                if corrupt:
                    tables.append(table)
                elif table.num_rows:
                    out.write_table(table)
                bar.update(1)
                bar.set_postfix(day=day.isoformat(), events=f"{written:,}")
        if corrupt:
            rows = _write_corrupted(
                folder, pa.concat_tables(tables), inject, day, ads_frame, cfg.seed, day_index
            )
            injected[day.isoformat()] = rows
        events_per_day[day.isoformat()] = written
    bar.close()

    seconds = time.perf_counter() - started
    total = sum(events_per_day.values())
    summary = {
        "source": "synthetic",
        "events": total,
        "events_per_day": events_per_day,
        "users": cfg.num_users,
        "ads": cfg.num_ads,
        "seconds": round(seconds, 3),
        "events_per_s": round(total / seconds, 1) if seconds > 0 else None,
        "injected": injected,
    }
    run_dir = ws.raw("_runs") / f"synthetic-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S%fZ}"
    save_config(cfg, run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    summary["run_dir"] = str(run_dir)
    return summary


def _check_inject(inject: Mapping[str, float] | None) -> dict[str, float]:
    rates = dict(inject or {})
    unknown = sorted(set(rates) - set(DEFECTS))
    if unknown:
        raise ValueError(f"unknown defect class(es) {unknown}; known: {list(DEFECTS)}")
    for name, rate in rates.items():
        if not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"defect rate for {name} must be in [0, 1], got {rate}")
    return {name: float(rate) for name, rate in rates.items() if float(rate) > 0}


def _write_corrupted(folder, table, inject, day, ads_frame, seed, day_index) -> dict[str, int]:
    try:
        from features.sources.defects import inject_defects
    except ImportError as err:  # written by another stage; generation without inject never needs it
        raise RuntimeError("defect injection needs features/sources/defects.py (inject_defects)") from err
    rng = np.random.default_rng(np.random.SeedSequence([seed, day_index + 1, 0xDEFEC7]))
    events, counts = inject_defects(table.to_pandas(), inject, day=day, ads=ads_frame, rng=rng)
    pq.write_table(writer.corrupted_table(events, "events"), folder / writer.EVENTS_FILE)
    counts = {name: int(n) for name, n in counts.items()}
    writer.write_injected(folder, counts, inject)
    return counts


# ----------------------------------------------------------------------------------------------- the world


def _build_world(cfg: SyntheticConfig) -> _World:
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
    return _World(
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


def _initial_state(cfg: SyntheticConfig, world: _World) -> _State:
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0, 1]))
    n, w = cfg.num_users, cfg.recent_window
    users = np.arange(n)
    return _State(
        short_term=_sample_rows(world.theta_cdf, users, rng),
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


def _sample_rows(cdf: np.ndarray, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One categorical draw per entry of ``rows`` from that row of ``cdf`` (a single searchsorted)."""
    if rows.size == 0:
        return np.zeros(0, dtype=np.int32)
    lo, hi = int(rows.min()), int(rows.max()) + 1
    block = cdf[lo:hi].astype(np.float64) + np.arange(hi - lo)[:, None]
    local = rows - lo
    index = np.searchsorted(block.ravel(), local + rng.random(rows.size), side="right")
    return np.clip(index - local * cdf.shape[1], 0, cdf.shape[1] - 1).astype(np.int32)


def _roll(old: np.ndarray, values: np.ndarray, counts: np.ndarray) -> np.ndarray:
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


# ------------------------------------------------------------------------------------------------ one chunk


def _simulate_chunk(cfg, world: _World, state: _State, users: slice, day_index: int, day: dt.date, rng):
    """Events of the users in ``users`` for one day, as an arrow table sorted by (user, time); updates ``state``."""
    user_ids = np.arange(users.start, users.stop)
    n_users = user_ids.size
    counts = np.minimum(
        rng.poisson(cfg.events_per_user_day * world.activity[users]), cfg.max_events_per_user_day
    )
    local = np.repeat(np.arange(n_users), counts)
    user = user_ids[local]
    starts = np.cumsum(counts) - counts
    position = np.arange(local.size) - starts[local]
    t = rng.integers(0, DAY_US, local.size)
    t = t[np.argsort(local * DAY_US + t, kind="stable")]

    short_term = _short_term_at(cfg, world, state, users, day_index, local, t, rng)
    category, is_impression, action = _base_actions(cfg, world, user, short_term, rng)
    ad = world.ads_by_category[
        world.category_start[category]
        + (rng.random(local.size) * world.category_count[category]).astype(np.int64)
    ]
    advertiser = world.ad_advertiser[ad]
    surface = _sample_rows(world.surface_cdf, user, rng)

    engaged = np.isin(action, [ACTION_ID[a] for a in ENGAGING_ACTIONS])
    engaged_category = np.where(engaged, category, -1).astype(np.int32)
    engaged_advertiser = np.where(engaged, advertiser, -1).astype(np.int32)

    imp = np.flatnonzero(is_impression)
    matches_category, matches_advertiser = _recent_matches(
        cfg, state, imp, user, position, category, advertiser, engaged_category, engaged_advertiser
    )
    imp_user, imp_ad, imp_adv = user[imp], ad[imp], advertiser[imp]
    affinity = np.log(cfg.num_categories * world.theta[imp_user, category[imp]].astype(np.float64))
    click_logit = (
        cfg.click_base
        + cfg.click_quality * (2.0 * world.ad_quality[imp_ad] - 1.0)
        + cfg.click_long_term * np.clip(affinity, -3.0, 3.0)
        + cfg.click_recent_category * matches_category
        + cfg.click_recent_advertiser * matches_advertiser
        + SURFACE_EFFECT[surface[imp]]
    )
    click = rng.random(imp.size) < _sigmoid(click_logit)
    repeat = (state.converted_advertisers[imp_user] == imp_adv[:, None]).any(axis=1)
    conversion_logit = (
        cfg.conversion_base
        + cfg.conversion_affinity * (world.user_vec[imp_user] * world.advertiser_vec[imp_adv]).sum(axis=1)
        + cfg.conversion_repeat * repeat
    )
    conversion = click & (rng.random(imp.size) < _sigmoid(conversion_logit))

    # Follow-up events of positive impressions, clamped to the day so the partition stays exact.
    clicked = imp[click]
    click_t = np.minimum(t[clicked] + rng.integers(SECOND_US, 30 * SECOND_US + 1, clicked.size), DAY_US - 1)
    converted = conversion[click]
    conversion_t = np.minimum(
        click_t[converted] + rng.integers(5 * SECOND_US, 600 * SECOND_US + 1, int(converted.sum())),
        DAY_US - 1,
    )

    # Carry the state to the next day (only what the labels above read).
    state.recent_category[users] = _roll(state.recent_category[users], engaged_category, counts)
    state.recent_advertiser[users] = _roll(state.recent_advertiser[users], engaged_advertiser, counts)
    clicks_per_user = np.bincount(local[clicked], minlength=n_users)
    state.clicked_advertisers[users] = _roll(
        state.clicked_advertisers[users], advertiser[clicked], clicks_per_user
    )
    conversions_per_user = np.bincount(local[clicked[converted]], minlength=n_users)
    state.converted_advertisers[users] = _roll(
        state.converted_advertisers[users], advertiser[clicked[converted]], conversions_per_user
    )

    click_label = np.zeros(local.size, dtype=np.int8)
    click_label[imp] = click
    conversion_label = np.zeros(local.size, dtype=np.int8)
    conversion_label[imp] = conversion
    follow = np.concatenate([clicked, clicked[converted]])
    columns = {
        "local": np.concatenate([local, local[follow]]),
        "ad": np.concatenate([ad, ad[follow]]),
        "action": np.concatenate(
            [
                action,
                np.full(clicked.size, ACTION_ID["click"]),
                np.full(int(converted.sum()), ACTION_ID["conversion"]),
            ]
        ),
        "surface": np.concatenate([surface, surface[follow]]),
        "t": np.concatenate([t, click_t, conversion_t]),
        "click": np.concatenate([click_label, np.zeros(follow.size, np.int8)]),
        "conversion": np.concatenate([conversion_label, np.zeros(follow.size, np.int8)]),
    }
    order = np.argsort(columns["local"] * DAY_US + columns["t"], kind="stable")
    n = order.size
    event_id = np.arange(state.next_event_id, state.next_event_id + n, dtype=np.int64)
    state.next_event_id += n
    day_start_us = writer.day_bounds_us(day)[0]
    return pa.Table.from_arrays(
        [
            pa.array(event_id),
            pa.array(user_ids[columns["local"][order]].astype(np.int64)),
            pa.array(columns["ad"][order].astype(np.int64)),
            writer.strings(columns["action"][order], ACTIONS),
            writer.strings(columns["surface"][order], SURFACES),
            pa.array(day_start_us + columns["t"][order], TS),
            pa.array(columns["click"][order]),
            pa.array(columns["conversion"][order]),
        ],
        schema=EVENTS_SCHEMA,
    )


def _short_term_at(cfg, world, state, users, day_index, local, t, rng) -> np.ndarray:
    """The short-term category of each event; advances the per-user switch process through the day."""
    day_start_s, day_end_s = day_index * 86_400.0, (day_index + 1) * 86_400.0
    current = state.short_term[users].copy()
    at_day_start = current.copy()
    next_switch = state.next_switch_s[users].copy()
    switch_user, switch_t, switch_category = [], [], []
    due = np.flatnonzero(next_switch < day_end_s)
    while due.size:
        drifted = rng.random(due.size) < 0.5
        new = np.where(
            drifted,
            rng.integers(0, cfg.num_categories, due.size),
            _sample_rows(world.theta_cdf, due + users.start, rng),
        ).astype(np.int32)
        switch_user.append(due)
        switch_t.append(((next_switch[due] - day_start_s) * SECOND_US).astype(np.int64))
        switch_category.append(new)
        current[due] = new
        next_switch[due] += rng.exponential(cfg.short_term_hours * 3600, due.size)
        due = due[next_switch[due] < day_end_s]
    state.short_term[users] = current
    state.next_switch_s[users] = next_switch
    if not switch_user:
        return at_day_start[local]
    s_user, s_t, s_cat = (np.concatenate(x) for x in (switch_user, switch_t, switch_category))
    order = np.argsort(s_user * DAY_US + s_t, kind="stable")
    keys, s_user, s_cat = (s_user * DAY_US + s_t)[order], s_user[order], s_cat[order]
    last = np.searchsorted(keys, local * DAY_US + t, side="right") - 1
    valid = (last >= 0) & (s_user[np.maximum(last, 0)] == local)
    return np.where(valid, s_cat[np.maximum(last, 0)], at_day_start[local])


def _base_actions(cfg, world, user, short_term, rng):
    """Category, impression flag and action code of every base event."""
    n = user.size
    long_term = _sample_rows(world.theta_cdf, user, rng)
    uniform = rng.integers(0, cfg.num_categories, n)
    is_impression = rng.random(n) < cfg.impression_share
    organic = np.array([ACTION_ID[a] for a in ORGANIC_ACTIONS])[
        rng.choice(len(ORGANIC_ACTIONS), n, p=ORGANIC_PROBS)
    ]
    action = np.where(is_impression, ACTION_ID["impression"], organic)
    r = rng.random(n)
    organic_category = np.where(r < cfg.short_term_share, short_term, long_term)
    organic_category = np.where(action == ACTION_ID["hide"], uniform, organic_category)
    targeted = np.where(
        r < cfg.target_short_term,
        short_term,
        np.where(r < cfg.target_short_term + cfg.target_long_term, long_term, uniform),
    )
    category = np.where(is_impression, targeted, organic_category).astype(np.int32)
    return category, is_impression, action


def _recent_matches(
    cfg, state, imp, user, position, category, advertiser, engaged_category, engaged_advertiser
):
    """For each impression ``imp``: did the user engage with its category / advertiser in the last W base events
    (looking back into the carried tail of previous days), or click its advertiser on a previous day?"""
    user, position, category, advertiser = user[imp], position[imp], category[imp], advertiser[imp]
    w = cfg.recent_window
    matches_category = np.zeros(imp.size, dtype=bool)
    matches_advertiser = (state.clicked_advertisers[user] == advertiser[:, None]).any(axis=1)
    for lag in range(1, w + 1):
        today = position >= lag
        earlier = np.maximum(imp - lag, 0)
        carried = np.clip(w - lag + position, 0, w - 1)
        past_category = np.where(today, engaged_category[earlier], state.recent_category[user, carried])
        past_advertiser = np.where(today, engaged_advertiser[earlier], state.recent_advertiser[user, carried])
        matches_category |= past_category == category
        matches_advertiser |= past_advertiser == advertiser
    return matches_category, matches_advertiser


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
