"""One day of synthetic events for one chunk of users: base events, click and conversion labels, follow-ups.

``simulate_chunk`` draws the chunk's base events (impressions and organic actions), labels the impressions by
the click / conversion logits of ``features.sources.synthetic``, adds the follow-up click and conversion events,
and advances the carried ``State``.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from features.schema import ACTION_ID, ACTIONS, EVENTS_SCHEMA, SURFACES, TS
from features.sources import writer
from features.sources.synthetic_world import DAY_US, State, World, roll, sample_rows

if TYPE_CHECKING:
    from features.sources.synthetic import SyntheticConfig

SECOND_US = 1_000_000
# Click-logit offset per surface (feed, stories, reels, search, marketplace): intent is highest on search.
SURFACE_EFFECT = np.array([0.0, -0.3, 0.2, 0.6, 0.3])
ORGANIC_ACTIONS = ("view", "like", "share", "comment", "hide")
ORGANIC_PROBS = (0.55, 0.20, 0.05, 0.08, 0.12)
ENGAGING_ACTIONS = ("view", "like", "share", "comment")


def simulate_chunk(
    cfg: SyntheticConfig, world: World, state: State, users: slice, day_index: int, day: dt.date, rng
):
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
    surface = sample_rows(world.surface_cdf, user, rng)

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
    state.recent_category[users] = roll(state.recent_category[users], engaged_category, counts)
    state.recent_advertiser[users] = roll(state.recent_advertiser[users], engaged_advertiser, counts)
    clicks_per_user = np.bincount(local[clicked], minlength=n_users)
    state.clicked_advertisers[users] = roll(
        state.clicked_advertisers[users], advertiser[clicked], clicks_per_user
    )
    conversions_per_user = np.bincount(local[clicked[converted]], minlength=n_users)
    state.converted_advertisers[users] = roll(
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
            sample_rows(world.theta_cdf, due + users.start, rng),
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
    long_term = sample_rows(world.theta_cdf, user, rng)
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
