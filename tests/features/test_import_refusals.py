"""The importer refuses what is wrong and keeps what is right (issue 34, part 3): every error names the file
(and rows where rows are at fault), bad rows are quarantined with a reason instead of failing the file."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

from features.sources.interaction_format import InteractionFormat, InteractionFormatError
from features.sources.interactions import import_interactions
from gemflow.commands import sources as source_commands
from gemflow.workspace import Workspace

FMT = InteractionFormat(user_col="customer", item_col="sku", ts_col="time", label_col="clicked")


def shop_log(n: int = 300) -> pd.DataFrame:
    """A small shop log as a user has it: string ids, SKUs, ISO timestamps, click and purchase columns."""
    return pd.DataFrame(
        {
            "customer": [f"u_{1800 + i % 37}" for i in range(n)],
            "sku": [f"SKU-AB{i % 23:02d}" for i in range(n)],
            "time": [f"2026-03-0{1 + i % 3}T{i % 24:02d}:{i % 60:02d}:00Z" for i in range(n)],
            "clicked": [int(i % 4 == 0) for i in range(n)],
            "purchased": [int(i % 12 == 0) for i in range(n)],
        }
    )


def _cli(*args: str) -> tuple[int, str, str]:
    app = typer.Typer()
    source_commands.register(app)
    result = CliRunner().invoke(app, ["import-interactions", *args, "--no-progress"])
    return result.exit_code, result.stdout, result.stderr


def _import(tmp_path: Path, frame: pd.DataFrame, fmt: InteractionFormat = FMT) -> dict:
    return import_interactions(frame, fmt, Workspace(tmp_path / "ws"), progress=False)


def test_one_empty_user_id_is_quarantined_with_its_row_not_the_whole_file(tmp_path):
    log = shop_log()
    log.loc[41, "customer"] = None
    summary = _import(tmp_path, log)
    assert summary["interactions"] == 299 and summary["quarantined"] == 1
    quarantine = pd.read_parquet(summary["quarantine"])
    assert quarantine[["row", "reason"]].to_dict("records") == [
        {"row": 42, "reason": "customer: empty user id"}
    ]
    assert any("1 bad row(s) quarantined" in w for w in summary["warnings"])


def test_too_many_bad_rows_stop_the_import_naming_file_rows_and_reason(tmp_path):
    log = shop_log(20)
    log.loc[[2, 5, 7], "clicked"] = "maybe"
    path = tmp_path / "shop.csv"
    log.to_csv(path, index=False)
    code, _, err = _cli(str(path), "-w", str(tmp_path / "ws"), "--user-col", "customer", "--item-col", "sku",
                        "--ts-col", "time", "--label-col", "clicked")  # fmt: skip
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"error: {path}: 3 of 20 rows are bad")
    assert "clicked: not a 0/1 label in 3 row(s) (rows 3, 6, 8, e.g. ['maybe'])" in err
    assert not (tmp_path / "ws" / "raw" / "events").exists()


def test_timestamps_before_the_minimum_are_quarantined(tmp_path):
    log = shop_log()
    log["time"] = log["time"].astype(object)
    log.loc[[0, 1], "time"] = [
        "1969-12-31T23:00:00Z",
        "1970-01-01T00:00:00Z",
    ]  # a broken clock, a placeholder
    summary = _import(tmp_path, log)
    assert summary["first_day"] == "2026-03-01" and summary["quarantined"] == 2
    assert summary["quarantine_reasons"] == {"time: before min_ts 1990-01-01": 2}
    older = _import(tmp_path / "b", log, InteractionFormat(**{**FMT.__dict__, "min_ts": "1960-01-01"}))
    assert older["first_day"] == "1969-12-31" and older["quarantined"] == 0


def test_negative_epoch_numbers_are_quarantined(tmp_path):
    log = shop_log()
    log["time"] = 1_772_323_200 + pd.Series(range(len(log))) * 60  # 2026-03-01 onwards, in seconds
    log.loc[3, "time"] = -86_400
    summary = _import(tmp_path, log)
    assert summary["quarantined"] == 1 and summary["first_day"] == "2026-03-01"


def test_ambiguous_dates_need_a_ts_format(tmp_path):
    log = shop_log(30)
    log["time"] = [f"0{1 + i % 3}/03/2026 10:{i:02d}" for i in range(30)]
    with pytest.raises(
        InteractionFormatError,
        match=r"time: '01/03/2026 10:00' \(rows 1, 2, 3, 4, 5, ...\) could be day/month or month/day: give --ts-format",
    ):
        _import(tmp_path, log)
    fmt = InteractionFormat(**{**FMT.__dict__, "ts_format": "%d/%m/%Y %H:%M"})
    summary = _import(tmp_path, log, fmt)
    assert (summary["first_day"], summary["last_day"]) == ("2026-03-01", "2026-03-03")  # day first, as told


def test_a_purchase_column_becomes_conversions_and_an_unread_one_warns(tmp_path):
    log = shop_log()
    unread = _import(tmp_path / "a", log)
    assert unread["conversions"] == 0
    assert unread["warnings"] == [
        "column 'purchased' looks like a conversion flag but is not read, so every conversion is 0: "
        "give --conversion-col purchased"
    ]
    read = _import(tmp_path / "b", log, InteractionFormat(**{**FMT.__dict__, "conversion_col": "purchased"}))
    assert read["conversions"] == int(log["purchased"].sum()) == 25 and read["warnings"] == []
    # a purchase is a positive whatever the click column says
    assert read["positives"] == int((log["clicked"] | log["purchased"]).sum())


def test_a_semicolon_file_gets_a_delimiter_hint(tmp_path):
    path = tmp_path / "shop.csv"
    shop_log(10).to_csv(path, index=False, sep=";")
    code, _, err = _cli(str(path), "-w", str(tmp_path / "ws"), "--user-col", "customer", "--item-col", "sku",
                        "--ts-col", "time")  # fmt: skip
    assert code == 2 and f"error: {path}: interactions: missing column(s)" in err
    assert "its header looks ';'-delimited: give --delimiter ';'" in err
    code, out, _ = _cli(str(path), "-w", str(tmp_path / "ws"), "--user-col", "customer", "--item-col", "sku",
                        "--ts-col", "time", "--delimiter", ";")  # fmt: skip
    assert code == 0 and json.loads(out)["interactions"] == 10


def test_a_latin1_file_names_itself_and_takes_an_encoding(tmp_path):
    path = tmp_path / "shop.csv"
    log = shop_log(10)
    log.loc[4, "sku"] = "SKU-CAFÉ"
    log.to_csv(path, index=False, encoding="latin-1")
    args = [
        str(path),
        "-w",
        str(tmp_path / "ws"),
        "--user-col",
        "customer",
        "--item-col",
        "sku",
        "--ts-col",
        "time",
    ]
    code, _, err = _cli(*args)
    assert code == 2 and err.startswith(f"error: {path}: not utf-8 text (byte 0xc9 at position ")
    assert "--encoding latin-1" in err and "Traceback" not in err
    code, out, _ = _cli(*args, "--encoding", "latin-1")
    assert code == 0 and json.loads(out)["items"] == 10


def test_an_empty_file_is_named(tmp_path):
    path = tmp_path / "shop.csv"
    path.write_bytes(b"")
    code, _, err = _cli(str(path), "-w", str(tmp_path / "ws"), "--ts-col", "time")
    assert code == 2 and err.strip() == f"error: {path}: the file is empty (0 bytes)"


def test_malformed_yaml_config_is_one_line(tmp_path):
    path, config = tmp_path / "shop.csv", tmp_path / "import.yaml"
    shop_log(10).to_csv(path, index=False)
    config.write_text("user_col: customer\nitem_col: [sku\n")
    result = CliRunner().invoke(
        _app(), ["import-interactions", str(path), "-c", str(config), "--no-progress"], env={"COLUMNS": "400"}
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    text = " ".join(result.output.replace("│", " ").split())  # typer draws usage errors in a box
    assert (
        f"{config}: not valid YAML at line 3, column 1: expected ',' or ']', but got '<stream end>'" in text
    )


def _app() -> typer.Typer:
    app = typer.Typer()
    source_commands.register(app)
    return app
