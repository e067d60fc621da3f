"""Positive-only sequence files (the S3-Rec / SASRec format) through the importer: order, attributes, errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from features.sources.interaction_format import InteractionFormatError
from features.sources.sequences import import_sequences, read_item_attributes, read_sequences
from gemflow.cli import app
from gemflow.workspace import Workspace


def test_sequence_file_becomes_ordered_positive_impressions(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("1 10 11 12\n2 11 10\n\n3 12 12 10 11\n")
    attrs = tmp_path / "attrs.json"
    attrs.write_text(json.dumps({"10": [5, 7], "11": [7], "12": []}))
    ws = Workspace(tmp_path / "ws")
    summary = import_sequences(log, ws, item_attributes=attrs, progress=False)
    assert summary["interactions"] == summary["events"] == summary["positives"] == 9
    events = pd.concat(pd.read_parquet(p) for p in ws.raw("events").glob("date=*/*.parquet"))
    events = events.sort_values(["user_id", "ts"])
    assert events.groupby("user_id").ad_id.apply(list).to_dict() == {
        1: [10, 11, 12],
        2: [11, 10],
        3: [12, 12, 10, 11],
    }
    assert events.click.eq(1).all() and set(events.action) == {"impression"}
    ads = pd.concat(pd.read_parquet(p) for p in ws.raw("ads").glob("date=*/*.parquet")).drop_duplicates(
        "ad_id"
    )
    vocab = json.loads(
        (ws.raw("_runs") / next(p.name for p in ws.raw("_runs").iterdir()) / "vocabularies.json").read_text()
    )
    cats = {row.ad_id: [vocab["category"][c] for c in row.categories] for row in ads.itertuples()}
    assert cats == {10: ["5", "7"], 11: ["7"], 12: ["<none>"]}


def test_bad_sequence_files_are_clear_errors(tmp_path):
    with pytest.raises(InteractionFormatError, match="no such file"):
        read_sequences(tmp_path / "missing.txt")
    lonely = tmp_path / "lonely.txt"
    lonely.write_text("1 10 11\n7\n")
    with pytest.raises(InteractionFormatError, match=r"lonely.txt:2: a user with no items"):
        read_sequences(lonely)
    broken = tmp_path / "attrs.json"
    broken.write_text("{not json")
    with pytest.raises(InteractionFormatError, match="not JSON"):
        read_item_attributes(broken)
    broken.write_text(json.dumps({"10": 5}))
    with pytest.raises(InteractionFormatError, match="expected"):
        read_item_attributes(broken)
    result = CliRunner().invoke(app, ["import-sequences", str(lonely), "--workspace", str(tmp_path / "ws")])
    assert (
        result.exit_code == 2 and "a user with no items" in result.output and "Traceback" not in result.output
    )
