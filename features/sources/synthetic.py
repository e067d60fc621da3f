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
    DEFECTS,
    EVENTS_SCHEMA,
)
from features.sources import writer
from features.sources.synthetic_events import simulate_chunk
from features.sources.synthetic_world import build_world, initial_state
from gemflow.config import save_config
from gemflow.workspace import Workspace


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
    world = build_world(cfg)
    state = initial_state(cfg, world)
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
                table = simulate_chunk(cfg, world, state, users, day_index, day, rng)
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
