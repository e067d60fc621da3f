"""MovieLens-100K through the generic importer (skips when ../shared/data is absent)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from features.schema import SCHEMAS
from features.sources.movielens import import_movielens, load
from gemflow.commands import sources as source_commands
from gemflow.workspace import Workspace


@pytest.fixture(scope="module")
def imported(movielens_dir, tmp_path_factory) -> tuple[Workspace, dict]:
    ws = Workspace(tmp_path_factory.mktemp("movielens"))
    return ws, import_movielens(ws, movielens_dir, progress=False)


def _events(ws: Workspace) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(p) for p in sorted(ws.raw("events").glob("date=*"))], ignore_index=True)


def test_row_counts_match_the_ratings(imported, movielens_dir):
    ws, summary = imported
    ratings = load(movielens_dir)["inter"]
    events = _events(ws)
    impressions = events[events.action == "impression"]
    assert len(impressions) == len(ratings) == 100_000
    assert impressions.click.sum() == (ratings.rating >= 4).sum() == 55_375 == summary["positives"]
    assert impressions.conversion.sum() == (ratings.rating == 5).sum() == 21_201 == summary["conversions"]
    assert (events.action == "click").sum() == 55_375 and (events.action == "conversion").sum() == 21_201
    assert events.event_id.is_unique and set(events.surface) == {"feed"}
    assert summary["users"] == 943 and summary["items"] == 1682 and summary["ages_clipped"] > 0


def test_partitions_span_seven_months_in_the_exact_schema(imported):
    ws, summary = imported
    parts = sorted(ws.raw("events").glob("date=*"))
    assert summary["first_day"] == "1997-09-20" and summary["last_day"] == "1998-04-22"
    assert len(parts) == summary["days"] > 200
    for part in parts:
        day = pd.Timestamp(part.name[5:], tz="UTC")
        ts = pd.read_parquet(part, columns=["ts"]).ts
        assert ts.min() >= day and ts.max() < day + pd.Timedelta(days=1)
    last = parts[-1].name
    for table, file in [("events", "part-00000.parquet"), ("users", "users.parquet"), ("ads", "ads.parquet")]:
        assert pq.read_schema(ws.raw(table) / last / file).remove_metadata().equals(SCHEMAS[table])


def test_movies_become_ads_and_raters_become_users(imported):
    ws, summary = imported
    last = sorted(ws.raw("ads").glob("date=*"))[-1].name
    ads = pd.read_parquet(ws.raw("ads") / last / "ads.parquet").set_index("ad_id")
    users = pd.read_parquet(ws.raw("users") / last / "users.parquet").set_index("user_id")
    genres = json.loads((Path(summary["run_dir"]) / "vocabularies.json").read_text())
    toy_story = ads.loc[1]  # "Animation Children's Comedy", 1995
    assert [genres["category"][c] for c in toy_story.categories] == ["Animation", "Children's", "Comedy"]
    assert genres["category"][toy_story.category_id] == "Animation" and toy_story.advertiser_id == 1995
    assert len(genres["category"]) == 19 and (ads.advertiser_id == 0).sum() == 2  # two items without a year
    assert len(ads) == 1682 and len(users) == 943
    first = users.loc[1]  # 24, M, technician
    assert first.age == 24 and first.gender == "male" and genres["country"][first.country] == "technician"
    assert users.age.between(13, 100).all()


def test_cli_import_movielens(movielens_dir, tmp_path):
    app = typer.Typer()
    source_commands.register(app)
    args = ["import-movielens", "-w", str(tmp_path), "--data-dir", str(movielens_dir), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["events"] == 100_000 + 55_375 + 21_201
    missing = CliRunner().invoke(app, ["import-movielens", "-w", str(tmp_path), "--data-dir", str(tmp_path)])
    assert missing.exit_code == 2 and "not found" in missing.output
