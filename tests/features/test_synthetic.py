"""The synthetic generator: exact raw contract, determinism, partition boundaries, planted structure."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from features.schema import ACTIONS, DEFECTS, EVENTS_SCHEMA, SCHEMAS, SURFACES
from features.sources.synthetic import SyntheticConfig, generate
from gemflow.workspace import Workspace

SMALL = dict(
    num_users=300, num_ads=200, num_advertisers=30, days=3, users_per_chunk=128, start_date="2026-03-01"
)


def _days(cfg: SyntheticConfig) -> list[dt.date]:
    return [cfg.start() + dt.timedelta(days=i) for i in range(cfg.days)]


def _events(ws: Workspace, cfg: SyntheticConfig) -> pd.DataFrame:
    frames = [pd.read_parquet(ws.raw("events", day)) for day in _days(cfg)]
    return pd.concat(frames, ignore_index=True)


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> tuple[Workspace, SyntheticConfig, dict]:
    ws = Workspace(tmp_path_factory.mktemp("synthetic"))
    cfg = SyntheticConfig(**SMALL)
    return ws, cfg, generate(cfg, ws, progress=False)


def test_every_partition_has_the_exact_raw_schema(generated):
    ws, cfg, summary = generated
    for day in _days(cfg):
        for table, path in [
            ("events", ws.raw("events", day) / "part-00000.parquet"),
            ("users", ws.raw("users", day) / "users.parquet"),
            ("ads", ws.raw("ads", day) / "ads.parquet"),
        ]:
            assert pq.read_schema(path).remove_metadata().equals(SCHEMAS[table]), (table, day)
    assert summary["events"] == sum(summary["events_per_day"].values()) > 10_000
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "config.yaml").exists() and json.loads((run_dir / "summary.json").read_text())["events"]


def test_partition_boundaries_ids_and_labels(generated):
    ws, cfg, _ = generated
    ads = pd.read_parquet(ws.raw("ads", cfg.start()) / "ads.parquet")
    users = pd.read_parquet(ws.raw("users", cfg.start()) / "users.parquet")
    seen_ids = []
    for day in _days(cfg):
        events = pd.read_parquet(ws.raw("events", day))
        start = pd.Timestamp(day, tz="UTC")
        assert events.ts.min() >= start and events.ts.max() < start + pd.Timedelta(days=1)
        seen_ids.append(events.event_id.to_numpy())
        assert set(events.action) <= set(ACTIONS) and set(events.surface) <= set(SURFACES)
        assert events.ad_id.isin(ads.ad_id).all() and events.user_id.isin(users.user_id).all()
        labelled = events[(events.click == 1) | (events.conversion == 1)]
        assert (labelled.action == "impression").all()
        assert (events.conversion <= events.click).all()
        # Every positive impression is followed by exactly one click event (and conversions likewise).
        assert (events.action == "click").sum() == events.click.sum()
        assert (events.action == "conversion").sum() == events.conversion.sum()
    ids = np.concatenate(seen_ids)
    assert len(np.unique(ids)) == len(ids)
    assert ads.quality.between(0, 1).all() and users.age.between(13, 100).all()


def test_same_seed_gives_byte_identical_parquet_and_another_seed_does_not(tmp_path):
    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.parquet"))}

    cfg = SyntheticConfig(**{**SMALL, "num_users": 120, "days": 2})
    for name, seed in [("a", 7), ("b", 7), ("c", 8)]:
        generate(SyntheticConfig(**{**vars(cfg), "seed": seed}), Workspace(tmp_path / name), progress=False)
    a, b, c = (files(tmp_path / n / "raw") for n in "abc")
    assert len(a) == 6 and a == b
    assert a.keys() == c.keys() and a != c


def test_regenerating_a_day_replaces_its_partition(tmp_path):
    ws = Workspace(tmp_path)
    cfg = SyntheticConfig(**{**SMALL, "num_users": 50, "days": 1})
    generate(cfg, ws, progress=False)
    generate(cfg, ws, progress=False)
    assert [p.name for p in ws.raw("events", cfg.start()).iterdir()] == ["part-00000.parquet"]


def test_clicks_follow_recent_engagement_with_the_candidate_category(generated):
    """The planted target-aware signal, measured from the written logs only."""
    ws, cfg, _ = generated
    ads = pd.read_parquet(ws.raw("ads", cfg.start()) / "ads.parquet")[["ad_id", "category_id"]]
    events = _events(ws, cfg).merge(ads, on="ad_id").sort_values("event_id")
    base = events[~events.action.isin(["click", "conversion"])].copy()
    engaged = base.action.isin(["view", "like", "share", "comment"])
    base["engaged_category"] = np.where(engaged, base.category_id, -1)
    by_user = base.groupby("user_id").engaged_category
    recent = np.zeros(len(base), dtype=bool)
    for lag in range(1, cfg.recent_window + 1):
        recent |= (by_user.shift(lag) == base.category_id).to_numpy()
    base["recent_match"] = recent
    impressions = base[base.action == "impression"]
    ctr = impressions.groupby("recent_match").click.mean()
    counts = impressions.recent_match.value_counts()
    assert counts.min() > 500
    assert ctr[True] > 3 * ctr[False], ctr.to_dict()


def test_history_lengths_span_two_orders_of_magnitude(generated):
    ws, cfg, _ = generated
    lengths = _events(ws, cfg).groupby("user_id").size()
    assert lengths.quantile(0.99) / lengths.quantile(0.01) >= 100, lengths.describe().to_dict()


def test_activity_can_be_zipf(tmp_path):
    cfg = SyntheticConfig(**{**SMALL, "days": 1, "activity": "zipf"})
    summary = generate(cfg, Workspace(tmp_path), progress=False)
    lengths = pd.read_parquet(Workspace(tmp_path).raw("events", cfg.start())).groupby("user_id").size()
    assert summary["events"] == lengths.sum() and lengths.max() / lengths.median() > 10


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"num_ads": 5}, "num_ads"),
        ({"days": 0}, "days"),
        ({"activity": "pareto"}, "activity"),
        ({"start_date": "March 1st"}, "start_date"),
        ({"target_short_term": 0.8, "target_long_term": 0.5}, "target_"),
    ],
)
def test_bad_config_gives_a_clear_error(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        generate(SyntheticConfig(**{**SMALL, **override}), Workspace(tmp_path), progress=False)


def test_unknown_defect_class_is_rejected_before_writing(tmp_path):
    ws = Workspace(tmp_path)
    with pytest.raises(ValueError, match="unknown defect"):
        generate(SyntheticConfig(**SMALL), ws, inject={"gremlins": 0.1}, progress=False)
    assert not ws.raw("events").exists()


def test_injected_defects_are_written_with_their_ground_truth(tmp_path):
    pytest.importorskip(
        "features.sources.defects", reason="defect injection (features/sources/defects.py) missing"
    )
    ws = Workspace(tmp_path)
    cfg = SyntheticConfig(**{**SMALL, "num_users": 100, "days": 2})
    second_day = cfg.start() + dt.timedelta(days=1)
    rates = {name: 0.02 for name in DEFECTS}  # every class, bad_type included (it changes a column's type)
    summary = generate(cfg, ws, inject=rates, inject_days=[second_day], progress=False)
    clean = ws.raw("events", cfg.start())
    assert not (clean / "_injected.json").exists()
    assert pq.read_schema(clean / "part-00000.parquet").remove_metadata().equals(EVENTS_SCHEMA)
    truth = json.loads((ws.raw("events", second_day) / "_injected.json").read_text())
    assert truth["rows"] == summary["injected"][second_day.isoformat()] and truth["rates"] == rates
    assert set(truth["rows"]) == set(DEFECTS) and min(truth["rows"].values()) > 0
    corrupted = pd.read_parquet(ws.raw("events", second_day) / "part-00000.parquet")
    generated_rows = summary["events_per_day"][second_day.isoformat()]
    assert len(corrupted) == generated_rows - truth["rows"]["volume_drop"]
    assert corrupted.isna().any(axis=1).sum() >= truth["rows"]["null_field"]
    off_vocabulary = ~corrupted.action.isin(ACTIONS) | ~corrupted.surface.isin(SURFACES)
    assert off_vocabulary.sum() >= truth["rows"]["bad_enum"]


def test_cli_generate_with_config_file_flags_and_overrides(tmp_path, repo_root):
    import typer
    from typer.testing import CliRunner

    from gemflow.commands import sources as source_commands

    app = typer.Typer()
    source_commands.register(app)
    args = ["generate", "-c", str(repo_root / "configs" / "synthetic-small.yaml"), "-w", str(tmp_path),
            "--users", "60", "--days", "2", "--start-date", "2026-05-01", "--set", "num_ads=50", "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert list(summary["events_per_day"]) == ["2026-05-01", "2026-05-02"] and summary["ads"] == 50
    recorded = (Path(summary["run_dir"]) / "config.yaml").read_text()
    assert "num_users: 60" in recorded and "start_date: '2026-05-01'" in recorded
    bad = CliRunner().invoke(app, ["generate", "-w", str(tmp_path), "--inject", "null_field:0.1"])
    assert bad.exit_code == 2 and "defect=rate" in bad.output
