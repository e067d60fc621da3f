"""The training DAGs' trigger rule (``gemflow train-due``): not before min_days, once per backfill, every N days,
and again when the embeddings' user-model version changes."""

from __future__ import annotations

import datetime as dt

from typer.testing import CliRunner

from gemflow.cli import app
from gemflow.schedule import TrainDue, decide, record_training
from gemflow.workspace import Workspace

D0 = dt.date(2026, 3, 1)


def _days(ws: Workspace, kind: str, n: int) -> None:
    for k in range(n):
        (ws.root / kind / "events" / f"date={D0 + dt.timedelta(days=k)}").mkdir(parents=True)


def test_not_before_enough_days_then_once_per_backfill(tmp_path):
    ws = Workspace(tmp_path)
    assert not decide(ws, TrainDue("user", None)).due  # nothing ingested
    _days(ws, "raw", 5)  # a backfill landed five days
    _days(ws, "offline", 2)
    v = decide(ws, TrainDue("user", D0 + dt.timedelta(days=1)))
    assert not v.due and "needs 3" in v.reason
    _days_more = [D0 + dt.timedelta(days=k) for k in range(2, 5)]
    for d in _days_more:
        (ws.offline("events") / f"date={d}").mkdir(parents=True)
    v = decide(ws, TrainDue("user", D0 + dt.timedelta(days=3)))
    assert not v.due and "backfill" in v.reason  # day 4 has landed: its event trains
    assert decide(ws, TrainDue("user", D0 + dt.timedelta(days=4))).due


def test_every_n_days_and_a_new_version(tmp_path):
    ws = Workspace(tmp_path)
    _days(ws, "raw", 5)
    _days(ws, "offline", 5)
    last = D0 + dt.timedelta(days=4)
    record_training(ws, "ranker", last, reason_key="gem-user-model/1")
    assert not decide(ws, TrainDue("ranker", last, every_days=1, reason_key="gem-user-model/1")).due
    v = decide(ws, TrainDue("ranker", last, every_days=1, reason_key="gem-user-model/2"))
    assert v.due and "gem-user-model/2" in v.reason
    assert decide(ws, TrainDue("ranker", last, every_days=0, reason_key="gem-user-model/1")).due  # force


def test_cli_exit_codes(tmp_path):
    ws = Workspace(tmp_path)
    runner = CliRunner()
    out = runner.invoke(app, ["train-due", "-w", str(ws.root), "--kind", "user"])
    assert out.exit_code == 4 and out.output.startswith("nothing to do:")
    _days(ws, "raw", 3)
    _days(ws, "offline", 3)
    out = runner.invoke(app, ["train-due", "-w", str(ws.root), "--kind", "user"])
    assert out.exit_code == 0 and out.output.startswith("train:")
    out = runner.invoke(app, ["train-due", "-w", str(ws.root), "--kind", "user", "--record"])
    assert out.exit_code == 0 and '"through": "2026-03-03"' in out.output
    assert runner.invoke(app, ["train-due", "-w", str(ws.root), "--kind", "user"]).exit_code == 4
