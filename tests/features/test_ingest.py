"""Ingestion through the real validation gate, offline store and Feast (SQLite): idempotence, order
independence, quarantine, and the CLI."""

from __future__ import annotations

import datetime as dt
import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from features.ingest import DateIngestError, IngestConfig, ingest, ingest_days
from features.ingestion.raw import IngestError, raw_days
from features.store import open_store
from features.validation import ValidationGateError
from gemflow.cli import app
from tests.features.helpers import DAY0, events_frame, land_days, write_raw

DAY1 = DAY0 + dt.timedelta(days=1)
DAY2 = DAY0 + dt.timedelta(days=2)
DAY3 = DAY0 + dt.timedelta(days=3)
USER_REFS = [
    "user_recent_events:recent_ad_ids",
    "user_recent_events:recent_time_gaps",
    "user_profile:user_age",
]
AD_REFS = ["ad_stats:impressions_7d", "ad_stats:ctr_1d", "ad_attributes:ad_quality"]


def fast_config() -> IngestConfig:
    return IngestConfig(
        gate={"data_docs": False}
    )  # data docs HTML is the gate's slow part; not under test here


def offline_bytes(ws) -> dict[str, bytes]:
    return {
        str(p.relative_to(ws.root)): p.read_bytes() for p in sorted(ws.root.glob("offline/*/*/*.parquet"))
    }


def online_values(ws) -> dict:
    store = open_store(ws)
    users = store.get_online_features(features=USER_REFS, entity_rows=[{"user_id": u} for u in (1, 2, 3)])
    ads = store.get_online_features(features=AD_REFS, entity_rows=[{"ad_id": a} for a in (10, 11, 12, 13)])
    return {"users": users.to_dict(), "ads": ads.to_dict()}


@pytest.mark.integration  # ~15 s: five real ingestions
def test_ingesting_a_date_twice_is_byte_identical(workspace):
    land_days(workspace, 2)
    summaries = [ingest(workspace, day, fast_config()) for day in (DAY0, DAY1)]
    assert summaries[1]["tables"]["events"]["quarantined"] == 0
    first_bytes, first_online = offline_bytes(workspace), online_values(workspace)
    assert {
        "offline/events/date=2026-01-06/part-0.parquet",
        "offline/ad_stats/date=2026-01-06/part-0.parquet",
        "offline/user_recent_events/date=2026-01-06/part-0.parquet",
    } <= set(first_bytes)
    assert all(v is not None for v in first_online["users"]["recent_ad_ids"])

    for day in (
        DAY1,
        DAY0,
    ):  # the same date again, then an earlier one (which refreshes DAY1's derived tables)
        ingest(workspace, day, fast_config())
        assert offline_bytes(workspace) == first_bytes
        assert online_values(workspace) == first_online


@pytest.mark.integration  # ~13 s: four real ingestions
def test_order_of_arrival_does_not_change_the_result(tmp_path):
    from gemflow.workspace import Workspace

    in_order, reversed_order = Workspace(tmp_path / "a"), Workspace(tmp_path / "b")
    for ws, days in ((in_order, (DAY0, DAY1)), (reversed_order, (DAY1, DAY0))):
        land_days(ws, 2)
        for day in days:
            ingest(ws, day, fast_config())
    assert offline_bytes(in_order) == offline_bytes(reversed_order)
    assert online_values(in_order) == online_values(reversed_order)


def test_summary_and_config_are_written_next_to_the_reports(workspace):
    land_days(workspace, 1)
    summary = ingest(workspace, DAY0, fast_config())
    on_disk = json.loads((workspace.reports(DAY0) / "ingest_summary.json").read_text())
    assert on_disk["tables"] == summary["tables"]
    assert (workspace.reports(DAY0) / "ingest_config.yaml").exists()
    assert (
        summary["tables"]["events"]["accepted"]
        == pq.read_metadata(workspace.offline("events", DAY0) / "part-0.parquet").num_rows
    )
    assert set(summary["timings_s"]) >= {"validate", "materialize", "push recent events", "total"}


def test_a_few_bad_rows_are_quarantined_and_the_rest_accepted(workspace):
    events = events_frame(DAY0, n=60)
    events.loc[events.index[5], "action"] = "teleport"  # one row outside the ACTIONS vocabulary
    write_raw(workspace, DAY0, events)
    summary = ingest(workspace, DAY0, fast_config())
    assert summary["tables"]["events"]["quarantined"] == 1
    assert summary["tables"]["events"]["accepted"] == len(events) - 1
    quarantine = pq.read_table(workspace.quarantine("events", DAY0)).to_pandas()
    assert quarantine["event_id"].tolist() == [events.event_id[5]]
    assert "action" in quarantine["reason"][0]


def test_a_failing_gate_writes_the_quarantine_and_nothing_else(workspace):
    events = events_frame(DAY0, n=40)
    events.loc[events.index[:10], "surface"] = "billboard"  # 25% bad rows: above the 5% threshold
    write_raw(workspace, DAY0, events)
    with pytest.raises(ValidationGateError):
        ingest(workspace, DAY0, fast_config())
    quarantine = pq.read_table(workspace.quarantine("events", DAY0)).to_pandas()
    assert len(quarantine) == 10 and quarantine["reason"].str.contains("surface").all()
    assert not list(workspace.offline("events").glob("*/*.parquet"))
    assert not (workspace.feature_repo / "online_store.db").exists()


def test_a_missing_raw_partition_is_a_clear_error(workspace):
    with pytest.raises(IngestError, match="no raw users partition for 2026-01-05"):
        ingest(workspace, DAY0, fast_config())


def test_cli_ingest_exit_codes(workspace):
    runner = CliRunner()
    land_days(workspace, 1)
    args = [
        "ingest",
        "--date",
        DAY0.isoformat(),
        "--workspace",
        str(workspace.root),
        "--set",
        "gate.data_docs=false",
    ]
    ok = runner.invoke(app, args)
    assert ok.exit_code == 0, ok.output
    assert '"accepted"' in ok.output

    missing = runner.invoke(app, [*args[:1], "--date", "2026-02-01", *args[3:]])
    assert missing.exit_code == 2 and "no raw users partition" in missing.output

    bad = events_frame(DAY1, n=40)
    bad.loc[bad.index[:20], "action"] = "teleport"
    write_raw(workspace, DAY1, bad)
    rejected = runner.invoke(app, [*args[:1], "--date", DAY1.isoformat(), *args[3:]])
    assert rejected.exit_code == 3


def test_a_bad_online_writer_is_a_clear_error():
    with pytest.raises(ValueError, match="online_writer must be one of"):
        IngestConfig(online_writer="turbo")


@pytest.mark.integration  # ~15 s: five real ingestions
def test_a_range_in_one_process_equals_one_date_at_a_time(tmp_path):
    from gemflow.workspace import Workspace

    per_date, ranged = Workspace(tmp_path / "a"), Workspace(tmp_path / "b")
    for ws in (per_date, ranged):
        land_days(ws, 1)
        land_days(ws, 2, start=DAY2)  # no partition on DAY1: a day without events is no error
    for day in (DAY0, DAY2, DAY3):
        ingest(per_date, day, fast_config())
    assert raw_days(ranged, DAY0, DAY3) == [DAY0, DAY2, DAY3]
    summary = ingest_days(ranged, raw_days(ranged, DAY0, DAY3), fast_config())
    assert (summary["dates"], summary["first"], summary["last"]) == (3, "2026-01-05", "2026-01-08")
    assert list(summary["per_date"]) == ["2026-01-05", "2026-01-07", "2026-01-08"]
    assert summary["accepted_events"] == sum(
        pq.read_metadata(f).num_rows for f in ranged.root.glob("offline/events/*/*.parquet")
    )
    assert offline_bytes(ranged) == offline_bytes(per_date)
    assert online_values(ranged) == online_values(per_date)
    # each date keeps its own report, as a single-date run writes it
    assert all((ranged.reports(d) / "ingest_summary.json").is_file() for d in (DAY0, DAY2, DAY3))


def test_a_range_stops_at_the_first_failing_date_and_names_it(workspace):
    land_days(workspace, 1)
    bad = events_frame(DAY1, n=40)
    bad.loc[bad.index[:20], "action"] = "teleport"  # 50% bad rows: the gate rejects DAY1
    write_raw(workspace, DAY1, bad)
    write_raw(workspace, DAY2)
    with pytest.raises(DateIngestError, match=r"ingest stopped at 2026-01-06 \(1 earlier date\(s\)") as err:
        ingest_days(workspace, [DAY2, DAY1, DAY0], fast_config())  # any order: oldest first
    assert err.value.day == DAY1 and err.value.done == [DAY0]
    assert isinstance(err.value.cause, ValidationGateError)
    ingested = {p.parent.name for p in workspace.root.glob("offline/events/*/*.parquet")}
    assert ingested == {"date=2026-01-05"}  # DAY2 was never reached


def test_a_range_without_partitions_or_backwards_is_a_clear_error(workspace):
    land_days(workspace, 1)
    with pytest.raises(IngestError, match="no raw events partition between 2026-02-01 and 2026-02-03"):
        raw_days(workspace, dt.date(2026, 2, 1), dt.date(2026, 2, 3))
    with pytest.raises(ValueError, match=r"ends \(2026-01-04\) before it starts \(2026-01-05\)"):
        raw_days(workspace, DAY0, DAY0 - dt.timedelta(days=1))


def test_cli_ingest_range_exit_codes(workspace):
    runner = CliRunner()
    land_days(workspace, 1)
    bad = events_frame(DAY1, n=40)
    bad.loc[bad.index[:20], "action"] = "teleport"
    write_raw(workspace, DAY1, bad)
    common = ["--workspace", str(workspace.root), "--set", "gate.data_docs=false"]

    ok = runner.invoke(app, ["ingest", "--dates", DAY0.isoformat(), *common])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output[ok.output.index("{") :])["dates"] == 1

    rejected = runner.invoke(app, ["ingest", "--start", "2026-01-05", "--end", "2026-01-06", *common])
    assert rejected.exit_code == 3
    assert "ingest stopped at 2026-01-06" in rejected.output and "validation gate" in rejected.output

    empty = runner.invoke(app, ["ingest", "--start", "2026-03-01", "--end", "2026-03-02", *common])
    assert empty.exit_code == 2 and "no raw events partition between" in empty.output
    missing = runner.invoke(app, ["ingest", "--dates", "2026-03-01", *common])
    assert missing.exit_code == 2 and "ingest stopped at 2026-03-01" in missing.output


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "give exactly one of --date"),
        (["--date", "2026-01-05", "--dates", "2026-01-05"], "got --date and --dates"),
        (["--start", "2026-01-05"], "--start and --end go together"),
        (["--dates", "2026-13-01"], "is not a date"),
    ],
)
def test_cli_ingest_bad_date_flags_are_clear_errors(workspace, flags, message):
    result = CliRunner().invoke(app, ["ingest", *flags, "--workspace", str(workspace.root)])
    assert result.exit_code == 2 and message in result.output, result.output
