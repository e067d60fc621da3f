"""The demo's ranker uses the ad statistics the platform computes (issue 34, point 6).

A day's ``ad_stats`` row is valid from the day's end, so an example joins the counters of the days before it: on
the first landed day they are all missing. The platform lands ``backfill_days`` days (train, then one valid and
one test day); with three, the train split was the first day alone, every counter was constant there and
``DenseSpec.fit`` left all 15 out. This lands the platform's default number of days the way ``gemflow_land`` and
``gemflow_ingest`` do (on the tiny synthetic source, the tiny platform's, for time) and builds the ranker's
training set as ``gemflow_ranker`` does.
"""

from __future__ import annotations

import datetime as dt

import pytest
from typer.testing import CliRunner

from features.feature_repo.tables import STATS_WINDOWS, stats_column
from gemflow.cli import app
from gemflow.platform_env import REPO, PlatformConfig
from models.training.data import TrainingSet
from models.training.dense import DenseSpec

EPOCH = dt.date(2026, 1, 1)


def gemflow(*argv: str) -> str:
    result = CliRunner().invoke(app, list(argv))
    assert result.exit_code == 0, f"gemflow {' '.join(argv)}:\n{result.output}\n{result.exception!r}"
    return result.output


@pytest.mark.integration
def test_the_demo_ranker_keeps_every_ad_stats_column(tmp_path):
    cfg = PlatformConfig()
    days = [EPOCH + dt.timedelta(days=i) for i in range(cfg.backfill_days)]
    ws = str(tmp_path / "ws")
    synthetic = str(REPO / "configs/embedded-tiny-synthetic.yaml")
    for day in days:
        gemflow("land-synthetic", "-w", ws, "-c", synthetic, "--date", str(day), "--epoch", str(EPOCH))
    gemflow("ingest", "-w", ws, "--start", days[0].isoformat(), "--end", days[-1].isoformat())
    gemflow("build-training-set", "-w", ws, "--name", "ranker", "--end", days[-1].isoformat())

    data = TrainingSet(tmp_path / "ws" / "training" / "ranker")
    counters = [
        stats_column(k, d)
        for d in STATS_WINDOWS
        for k in ("impressions", "clicks", "conversions", "ctr", "cvr")
    ]
    assert len(counters) == 15 and set(counters) <= set(data.dense_columns())
    kept = DenseSpec.fit(data.dense_frame().iloc[data.split_rows("train")], data.dense_columns()).columns
    assert set(counters) <= set(kept), f"left out: {sorted(set(counters) - set(kept))}"
