"""``gemflow retrieval-index``: the index a server would build from the newest refresh, measured (recall@K against
exact search over a sample of its own users' queries) and tracked in MLflow under the user-model version."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gemflow.cli import app
from gemflow.workspace import Workspace
from models.embeddings.ad_vectors import RETRIEVAL_TABLE
from serving.retrieval.index_files import current_index
from serving.retrieval.report import EXPERIMENT, REPORT_FILE
from tests.serving.retrieval.test_service import ADS, write_refresh

runner = CliRunner()


@pytest.fixture
def ws(tmp_path) -> Workspace:
    ws = Workspace(tmp_path / "ws")
    write_refresh(ws.offline(RETRIEVAL_TABLE, dt.date(2026, 3, 1)), "user-model/3", 0, 0)
    write_refresh(ws.offline(RETRIEVAL_TABLE, dt.date(2026, 3, 2)), "user-model/4", 0, 1)
    return ws


def test_the_newest_refresh_is_measured_and_tracked(ws):
    args = ["retrieval-index", "--workspace", str(ws.root), "--k", "50", "--sample", "10",
            "--set", "retrieval.index.kind=hnsw", "--set", "retrieval.index.hnsw_m=8"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    assert report["model_version"] == "user-model/4" and report["kind"] == "hnsw"  # the newest day's
    assert (report["ads"], report["users"], report["sampled_users"], report["k"]) == (ADS, 10, 10, 50)
    assert 0.9 <= report["recall_at_50"] <= 1.0 and report["index_bytes"] > ADS * 8 * 4
    written = json.loads((ws.offline(RETRIEVAL_TABLE, dt.date(2026, 3, 2)) / REPORT_FILE).read_text())
    assert written["recall_at_50"] == report["recall_at_50"]
    # the build is on disk for the servers to map, and it is the one measured
    assert current_index(ws.offline(RETRIEVAL_TABLE, dt.date(2026, 3, 2))) == Path(report["index_path"])

    import mlflow

    from models.tracking.mlflow_store import use

    use(ws)
    runs = mlflow.search_runs(experiment_names=[EXPERIMENT])
    assert len(runs) == 1 and runs.iloc[0]["run_id"] == report["mlflow_run_id"]
    assert runs.iloc[0]["tags.gemflow.user_model_version"] == "user-model/4"
    assert runs.iloc[0]["metrics.recall_at_50"] == pytest.approx(report["recall_at_50"])
    assert runs.iloc[0]["metrics.build_seconds"] >= 0


def test_a_given_day_and_a_missing_one(ws):
    base = ["retrieval-index", "--workspace", str(ws.root), "--k", "20", "--sample", "5", "--no-track"]
    result = runner.invoke(app, [*base, "--date", "2026-03-01"])
    assert result.exit_code == 0, result.output
    assert '"model_version": "user-model/3"' in result.output
    assert '"kind": "exact"' in result.output and '"recall_at_20": 1.0' in result.output  # auto: 400 ads
    missing = runner.invoke(app, [*base, "--date", "2026-02-01"])
    assert missing.exit_code == 2 and "no retrieval vectors under" in missing.output


def test_a_refresh_without_vectors_is_skipped_for_the_dag(tmp_path):
    """A click-objective user model's refresh writes no vectors: the DAG's index task is skipped (exit 4)."""
    ws = Workspace(tmp_path / "ws")
    args = ["retrieval-index", "--workspace", str(ws.root), "--no-track", "--skip-without-vectors"]
    result = runner.invoke(app, args)
    assert result.exit_code == 4 and "nothing to index" in result.output
    assert runner.invoke(app, args[:-1]).exit_code == 2  # without the flag: an error, as before
