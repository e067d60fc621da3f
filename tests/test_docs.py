"""The front door and the figures: README within 12 KB naming every top-level folder, and every row of
docs/benchmarks.md carrying its command, date, CPU and commit (written by bench/report.py, never by hand)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from bench.report import COLUMNS, HEADER, Provenance, cpu_slug, record

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
SECTION = re.compile(r"<!-- bench:([a-z0-9_.-]+) -->\n(.*?)<!-- /bench:\1 -->", re.S)
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}( \d{2}:\d{2})?$")


def cells(line: str) -> list[str]:
    """The cells of a markdown table row (escaped pipes stay inside their cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def table_rows(section: str) -> list[list[str]]:
    lines = [line for line in section.splitlines() if line.startswith("|")]
    assert lines and cells(lines[0]) == list(COLUMNS), f"table header should be {COLUMNS}"
    return [cells(line) for line in lines[2:]]


def check_rows(text: str) -> dict[str, list[list[str]]]:
    sections = {key: table_rows(body) for key, body in SECTION.findall(text)}
    for key, rows in sections.items():
        assert rows, f"section {key} has no rows"
        for row in rows:
            assert len(row) == len(COLUMNS), f"{key}: {row}"
            figure, value, command, date, cpu, commit = row
            assert figure and value, f"{key}: a row without its figure: {row}"
            assert re.fullmatch(r"`[^`]+`", command), f"{key}: no command in {row}"
            assert DATE.match(date.removesuffix(" (carried over)")), f"{key}: no date in {row}"
            assert cpu and "cores" in cpu, f"{key}: no CPU in {row}"
            assert commit.startswith("`") and len(commit) > 2, f"{key}: no commit in {row}"
        figures = [row[0] for row in rows]
        assert len(figures) == len(set(figures)), f"{key}: a figure appears twice"
    return sections


def test_readme_is_a_front_door_of_at_most_12_kib():
    assert len(README.read_bytes()) <= 12_288


def test_readme_layout_names_every_top_level_folder():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folders = {path.split("/", 1)[0] for path in tracked.splitlines() if "/" in path}
    folders = {f for f in folders if not f.startswith(".")}
    layout = README.read_text().split("## Layout", 1)
    assert len(layout) == 2, "README has no '## Layout' section"
    section = layout[1].split("\n## ", 1)[0]
    missing = sorted(f for f in folders if f"`{f}/" not in section)
    assert not missing, f"README's layout leaves out {missing}"


def test_every_benchmark_row_carries_its_command_date_cpu_and_commit():
    sections = check_rows(BENCHMARKS.read_text())
    for bench in ("serve.", "train.", "matmul_peak.t1."):
        assert any(key.startswith(bench) for key in sections), f"docs/benchmarks.md has no {bench}* section"


def test_no_doc_keeps_per_session_history():
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        assert not re.search(r"^#+ Round \d+", text, re.M), f"{doc.name}: 'Round N' history belongs in git"


def test_record_replaces_its_own_section_and_keeps_the_others(tmp_path: Path):
    doc = tmp_path / "benchmarks.md"
    here = Provenance.here()
    old = Provenance("bench/x.py --old", "2026-01-01 00:00", here.cpu, "abc1234")  # this machine, earlier
    other = Provenance("bench/x.py", "2026-01-02", "Other CPU (family 6 model 1, AMX), 2 cores", "def5678")
    record("x", "bench x", [("speed", "1 op/s"), ("size", "2 MiB")], prov=old, path=doc)
    record("x", "bench x", [("speed", "4 op/s")], prov=other, carried_over="docs/x.md", path=doc)
    record("y", "bench y", [("speed", "5 op/s")], prov=old, path=doc)
    record("x", "bench x", [("speed", "3 op/s")], path=doc)  # a fresh run: this command, now, this commit
    text = doc.read_text()
    assert text.startswith(HEADER)
    sections = check_rows(text)
    mine = f"x.{cpu_slug(here.cpu)}"
    assert set(sections) == {mine, "x.other-cpu-f6m1", f"y.{cpu_slug(here.cpu)}"}
    assert [r[:2] for r in sections[mine]] == [["speed", "3 op/s"]]  # replaced, its old 'size' row gone
    assert sections[mine][0][2] == f"`{here.command}`"
    assert sections["x.other-cpu-f6m1"][0][1:] == ["4 op/s", "`bench/x.py`", "2026-01-02", other.cpu, "`def5678`, carried over"]  # fmt: skip
    assert sections[f"y.{cpu_slug(here.cpu)}"][0][1] == "5 op/s"
    assert "*Carried over* from docs/x.md" in text
    assert text.count(f"<!-- bench:{mine} -->") == 1


def test_record_refuses_an_empty_section_or_a_bad_key(tmp_path: Path):
    with pytest.raises(ValueError, match="no rows"):
        record("x", "bench x", [], path=tmp_path / "b.md")
    with pytest.raises(ValueError, match="key"):
        record("X Y", "bench x", [("a", "b")], path=tmp_path / "b.md")
