"""Print the helm version and every object `helm template` renders for one values file, as a kind/name table.

    .venv/bin/python -m tests.helm.list_components [values-trial.yaml]     (or: make helm-list)

Rendered like the tests render (tests/helm/render.py): the official Airflow chart dependency cannot be downloaded
here, so it is left out (airflow.enabled=false) and listed as the dependency it is.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import yaml

from tests.helm.render import CHART, NAMESPACE, copy_without_airflow, helm, render


def component_rows(docs: list[dict]) -> list[tuple[str, str, str]]:
    rows = []
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        rows.append((doc["kind"], doc["metadata"]["name"], labels.get("app.kubernetes.io/component", "")))
    return sorted(rows)


def main(values_file: str = "values-trial.yaml") -> None:
    print(f"helm {helm('version', '--short').stdout.strip()}")
    with tempfile.TemporaryDirectory() as tmp:
        docs = render(copy_without_airflow(Path(tmp)), values_file)
    rows = component_rows(docs)
    print(f"\n# helm template gemflow helm/gemflow -n {NAMESPACE} -f {values_file}: {len(rows)} objects")
    width = max(len(kind) for kind, _, _ in rows)
    name_width = max(len(name) for _, name, _ in rows)
    print(f"{'KIND':<{width}}  {'NAME':<{name_width}}  COMPONENT")
    for kind, name, component in rows:
        print(f"{kind:<{width}}  {name:<{name_width}}  {component}")
    (dep,) = yaml.safe_load((CHART / "Chart.yaml").read_text())["dependencies"]
    print(
        f"\n+ dependency {dep['name']} {dep['version']} ({dep['repository']}, condition {dep['condition']}): "
        "the official Airflow chart, rendered after `helm dependency build` on a machine that can fetch it"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
