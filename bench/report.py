"""Write a bench's headline figures into docs/benchmarks.md, replacing that bench's own section.

A bench called with ``--record`` (see ``add_record_flag``) passes its figures to ``record``; every row gets the
command line that produced it, the date (UTC), the CPU model (from /proc/cpuinfo) and core count, and the git
commit. Each section sits between ``<!-- bench:KEY.CPU -->`` and ``<!-- /bench:KEY.CPU -->`` markers (KEY names the
bench and its configuration, CPU the machine), so a new run replaces exactly its own rows for that machine and
nothing else: the figures are regenerated, never edited by hand, and one figure lives in one place.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemflow.markdown import write_marked_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
ENV = ("OMP_NUM_THREADS", "GEMFLOW_NATIVE_KERNELS")  # settings outside argv that change what a bench measures
ISA = (("amx_bf16", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))  # widest first
COLUMNS = ("figure", "value", "command", "date (UTC)", "CPU", "commit")
HEADER = """# Benchmarks

Every speed figure the project quotes, once. Each section is written by its bench run with `--record`
(`bench/report.py`), which replaces that bench's section for the same CPU: do not edit rows by hand, run the
command again. Each row names the command that produced it, when (UTC), the CPU and the commit. Rows marked
*carried over* were measured before the recorder existed and copied from the design notes (`docs/serving-speed.md`,
`docs/training-speed.md`); re-running their command with `--record` on that CPU replaces them. Figures from
different CPUs do not compare, and on a shared machine only the per-CPU-second ones hold. Model quality (NE, AUC,
HR@10, scaling fits) lives in the model-results docs and `docs/scaling.md`, each table with its command.
"""


@dataclass(frozen=True)
class Provenance:
    """Where a row's figure came from: the command line, when, on which CPU, at which commit."""

    command: str
    date: str
    cpu: str
    commit: str

    @classmethod
    def here(cls, argv: list[str] | None = None) -> Provenance:
        """The provenance of a figure this process measured just now."""
        argv = list(sys.argv if argv is None else argv)
        if argv:
            script = Path(argv[0])
            if script.is_absolute() and script.is_relative_to(ROOT):
                argv[0] = str(script.relative_to(ROOT))
        env = [f"{k}={os.environ[k]}" for k in ENV if k in os.environ]
        return cls(
            command=shlex.join(env + argv),
            date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
            cpu=cpu_model(),
            commit=git_commit(),
        )


def cpu_model() -> str:
    """The CPU's model name, family/model, widest vector ISA and usable cores, e.g.
    'AMD EPYC (family 25 model 1, AVX2), 2 cores': VM guests often report a bare vendor name."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    isa = next((label for flag, label in ISA if flag in flags), "")
    detail = ", ".join(
        x for x in (f"family {info['cpu family']} model {info['model']}" if "model" in info else "", isa) if x
    )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}{f' ({detail})' if detail else ''}, {cores} cores"


def cpu_slug(cpu: str) -> str:
    """A section-key suffix for a ``cpu_model()`` string: 'AMD EPYC (family 25 model 1, AVX2), 2 cores' ->
    'amd-epyc-f25m1'."""
    name = re.sub(r"[^a-z0-9]+", "-", cpu.split(" (")[0].split(",")[0].lower()).strip("-")
    ids = re.search(r"family (\d+) model (\d+)", cpu)
    return name + (f"-f{ids[1]}m{ids[2]}" if ids else "")


def git_commit() -> str:
    """The short commit of the checkout, with '+changes' when tracked files outside the docs differ from it
    (markdown cannot change a measurement; code can)."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!*.md"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}+changes" if dirty else sha


def add_record_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--record",
        action="store_true",
        help=f"also write the headline figures into {BENCHMARKS.relative_to(ROOT)} (this bench's section)",
    )


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def render_section(title: str, rows: list[tuple[str, str]], prov: Provenance, carried_over: str = "") -> str:
    """A section's body: a title, an optional note, and a table of rows each with its full provenance."""
    if not rows:
        raise ValueError(f"bench section {title!r}: no rows to record")
    commit = f"`{prov.commit}`" + (", carried over" if carried_over else "")
    lines = [f"## {title}", ""]
    if carried_over:
        lines += [f"*Carried over* from {carried_over}; not re-run since.", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for figure, value in rows:
        cells = (figure, value, f"`{_cell(prov.command)}`", prov.date, prov.cpu, commit)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def record(
    key: str,
    title: str,
    rows: list[tuple[str, str]],
    *,
    prov: Provenance | None = None,
    carried_over: str = "",
    path: Path = BENCHMARKS,
) -> Path:
    """Replace the section ``key`` of this machine (``prov.cpu``) in ``path`` with ``rows`` (figure, value), each
    stamped with ``prov`` (default: this command, now, this CPU, this commit)."""
    if not re.fullmatch(r"[a-z0-9_.-]+", key):
        raise ValueError(f"bench section key {key!r}: use lowercase letters, digits, '.', '_' or '-'")
    prov = prov or Provenance.here()
    key = f"{key}.{cpu_slug(prov.cpu)}"
    body = render_section(f"{title}, {prov.cpu.split(' (')[0]}", rows, prov, carried_over)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:  # one writer at a time: two benches may finish together (the lock is on the folder: no lock file)
        fcntl.flock(folder, fcntl.LOCK_EX)
        write_marked_section(path, f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->", body, HEADER)
    finally:
        os.close(folder)
    print(f"recorded {len(rows)} figure(s) in {path} (section {key})")
    return path
