"""CLI conventions: ``--version``, ``-h``, flags without a type placeholder, defaults shown, commands grouped by
pipeline stage in the order a user runs them."""

from __future__ import annotations

from importlib.metadata import version

from typer.testing import CliRunner

from gemflow.cli import PIPELINE, app

runner = CliRunner()


def test_version_and_short_help():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"gemflow {version('gemflow')}"
    for args in (["-h"], ["train", "-h"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0 and "Usage: gemflow" in result.output, result.output


def test_flags_have_no_placeholder_and_defaults_show():
    out = runner.invoke(app, ["train", "-h"], terminal_width=200).output
    resume = next(line for line in out.splitlines() if "--resume" in line)
    assert "<bool>" not in out and "<" not in resume.split("--resume", 1)[1].split("Continue")[0]
    out = runner.invoke(app, ["register-run", "-h"], terminal_width=200).output
    assert "[default: " in out  # options with a concrete default say it


def test_commands_are_grouped_in_pipeline_order():
    out = runner.invoke(app, ["-h"], terminal_width=200).output
    panels = [out.index(f" {panel} ") for panel in PIPELINE]
    assert panels == sorted(panels), "stage panels out of order"
    listed = {line.split()[1] for line in out.splitlines() if line.startswith("│ ") and len(line.split()) > 2}
    grouped = {c for names in PIPELINE.values() for c in names}
    assert {c.name for c in app.registered_commands} - grouped == set()  # every command has a stage
    assert out.index(" train ") < out.index(" register-run ") < out.index(" deploy ")
    assert "train" in listed
