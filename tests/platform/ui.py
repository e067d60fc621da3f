"""The platform's UIs in a real browser: Playwright (Python) driving Debian's Chromium (``make setup`` installs it).

``check_uis`` is what ``tests/platform/test_up_down.py`` runs after the first pipeline pass, before ``down``: the
Airflow UI (login as ``admin``, the DAG list with every gemflow DAG and its last run, the asset graph), the MLflow
UI (the experiments, a run's learning-curve plot, the registered models with their ``@champion`` alias) and the
ranker endpoint's ``/docs``. Each page is saved as a PNG; ``--out docs/img`` refreshes the README's screenshots
from a running platform:

    .venv/bin/python -m tests.platform.ui -w workspace/platform --out docs/img
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

CHAIN = ("gemflow_land", "gemflow_ingest", "gemflow_train", "gemflow_register", "gemflow_refresh",
         "gemflow_ranker", "gemflow_deploy")  # fmt: skip
TIMEOUT_MS = 120_000  # a page on 2 busy cores


@dataclass
class UiReport:
    shots: dict[str, Path] = field(default_factory=dict)
    seen: dict[str, str] = field(default_factory=dict)  # what each check read off the page


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise FileNotFoundError("Debian's chromium is not installed: `make setup` installs it (apt-get)")
    return path


def check_uis(airflow_url: str, password: str, mlflow_url: str, endpoint_url: str, out: Path) -> UiReport:
    """Open each UI as a user would, assert what it must show, save a screenshot of each page into ``out``."""
    from playwright.sync_api import expect, sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    report = UiReport()

    def shot(page, name: str) -> None:
        path = out / f"{name}.png"
        page.screenshot(path=str(path), full_page=False)
        report.shots[name] = path

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            expect.set_options(timeout=TIMEOUT_MS)

            # Airflow: sign in like a user (simple auth manager), then the DAG list.
            page.goto(f"{airflow_url}/")
            page.get_by_label(re.compile("username", re.I)).fill("admin")
            page.get_by_label(re.compile("password", re.I)).fill(password)
            page.get_by_role("button", name=re.compile("sign in|log in|login", re.I)).click()
            # the sign-in redirects: a goto while that navigation runs is aborted (net::ERR_ABORTED)
            page.wait_for_url(lambda url: "login" not in url)
            page.wait_for_load_state()
            # every gemflow DAG listed, each one's last run successful (the UI's own "last run" filter)
            page.goto(f"{airflow_url}/dags?tags=gemflow&last_dag_run_state=success")
            expect(page.get_by_text(f"{len(CHAIN)} Dags", exact=True)).to_be_visible()
            for dag_id in CHAIN:
                expect(page.get_by_role("link", name=dag_id, exact=True).first).to_be_visible()
            shot(page, "airflow-dags")
            page.goto(f"{airflow_url}/dags?tags=gemflow&last_dag_run_state=failed")
            expect(page.get_by_text("0 Dags", exact=True)).to_be_visible()

            # the asset graph, from the last asset of the chain: every DAG and asset upstream of the deploy
            page.goto(f"{airflow_url}/assets")
            page.get_by_role("link", name="gemflow.ranker_champion", exact=True).first.click()
            graph = page.locator(".react-flow")
            expect(graph).to_be_visible()
            for node in (*CHAIN[1:], "gemflow.features", "gemflow.user_model", "gemflow.champion",
                         "gemflow.embeddings", "gemflow.ranker_champion"):  # fmt: skip
                expect(graph.get_by_text(node, exact=True).first).to_be_attached()
            page.wait_for_timeout(2000)  # let the graph lay itself out
            shot(page, "airflow-asset-graph")

            # MLflow: experiments, a ranker run's learning curve, the registered models with @champion
            page.goto(f"{mlflow_url}/#/experiments")
            expect(page.get_by_text("gemflow-user-model").first).to_be_visible()
            expect(page.get_by_text("gemflow-ranker").first).to_be_visible()
            shot(page, "mlflow-experiments")

            exp, run = _latest_run(mlflow_url, "gemflow-ranker")
            page.goto(f"{mlflow_url}/#/experiments/{exp}/runs/{run}/artifacts/learning_curve.png")
            expect(page.get_by_text("learning_curve.png").first).to_be_visible()
            plot = page.get_by_role("img", name="learning_curve.png")
            expect(plot).to_be_visible()
            assert plot.evaluate("e => e.naturalWidth") > 100  # the plot's pixels arrived, not a broken image
            _close_assistant(page)
            shot(page, "mlflow-learning-curve")

            page.goto(f"{mlflow_url}/#/models")
            _close_promotion(page)
            _close_assistant(page)
            expect(page.get_by_text("gem-user-model").first).to_be_visible()
            expect(page.get_by_text("gem-ranker").first).to_be_visible()
            rows = page.get_by_role("row")
            for model in ("gem-user-model", "gem-ranker"):
                expect(rows.filter(has_text=model).filter(has_text="champion")).to_have_count(1)
            shot(page, "mlflow-registered-models")

            page.goto(f"{endpoint_url}/docs")
            expect(page.get_by_text("/v1/models/gem-ranker:predict", exact=True)).to_be_visible()
            shot(page, "endpoint-docs")
        finally:
            browser.close()
    return report


def _latest_run(mlflow_url: str, experiment: str) -> tuple[str, str]:
    """(experiment id, run id) of the newest run of ``experiment``, from MLflow's REST API."""
    import urllib.request

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(f"{mlflow_url}/api/2.0/mlflow/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    with urllib.request.urlopen(
        f"{mlflow_url}/api/2.0/mlflow/experiments/get-by-name?experiment_name={experiment}", timeout=30
    ) as r:
        exp = json.loads(r.read())["experiment"]["experiment_id"]
    runs = post("runs/search", {"experiment_ids": [exp], "max_results": 1, "order_by": ["start_time DESC"]})
    return exp, runs["runs"][0]["info"]["run_id"]


def _close_promotion(page) -> None:
    """MLflow 3 greets the registered-models page with a dialog about its new registry UI, over the aliases."""
    dialog = page.get_by_role("dialog")
    try:
        dialog.first.wait_for(state="visible", timeout=5000)
    except Exception:  # noqa: BLE001 (no dialog this time: nothing to close)
        return
    page.keyboard.press("Escape")
    dialog.first.wait_for(state="hidden", timeout=10000)
    page.wait_for_timeout(1000)  # the backdrop fades out


def _close_assistant(page) -> None:
    """MLflow 3 opens its assistant panel beside a run; close it so the screenshot shows the run."""
    close = page.get_by_role("button", name=re.compile("^close", re.I))
    if close.count():
        close.first.click()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "-w", "--workspace", type=Path, required=True, help="the running platform's workspace"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    state = json.loads((args.workspace / "platform" / "state.json").read_text())
    c = state["config"]
    passwords = args.workspace / "airflow" / "simple_auth_manager_passwords.json.generated"
    report = check_uis(
        f"http://{c['host']}:{c['airflow_port']}",
        json.loads(passwords.read_text())["admin"],
        f"http://{c['host']}:{c['mlflow_port']}",
        f"http://{c['host']}:{c['endpoint_port']}",
        args.out,
    )
    for name, path in report.shots.items():
        print(f"{name}: {path}")  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
