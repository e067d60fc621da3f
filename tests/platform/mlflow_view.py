"""MLflow's model-training view over a real run, in a real browser (Playwright + Debian's Chromium, as ``ui.py``).

Trains a small ranker (tracked) in a fresh workspace, registers it, serves the workspace's store with a real MLflow
server and opens the experiment as a user would: the experiment is tagged as model development, so MLflow 3 opens
its model-training view (runs, models) rather than the GenAI one (traces). Then the logged model's page, whose
metrics are the best epoch's and whose "Datasets used" lists the training set. Saves
``mlflow-model-training-view.png`` and ``mlflow-logged-model.png``:

    .venv/bin/python -m tests.platform.mlflow_view --out docs/img
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

from typer.testing import CliRunner

from gemflow.cli import app
from gemflow.config import load_config
from gemflow.workspace import Workspace
from models.config import TrainRunConfig
from models.tracking import mlflow_store
from models.tracking.mlflow_store import ui_link
from models.tracking.registry.gate import logged_model_id
from models.tracking.registry.server import start_server
from models.training.train import train
from tests.models.fixtures import write_training_set
from tests.platform.ui import TIMEOUT_MS, _close_assistant, chromium_path
from tests.ports import free_port

RANKER = {"training_set": "fx", "model": "ranker", "optim.epochs": 4, "optim.batch_size": 32, "optim.patience": 4,
          "ranker.d_model": 16, "ranker.num_heads": 2, "ranker.recent_events": 16,
          "ranker.use_user_tokens": False}  # fmt: skip


def trained_and_registered(root: Path) -> Workspace:
    ws = Workspace(root / "ws")
    write_training_set(ws.training("fx"), num_users=80, num_ads=40, num_categories=6, seed=7)
    train(load_config(TrainRunConfig, None, RANKER), ws)
    result = CliRunner().invoke(app, ["register-run", "--kind", "ranker", "-w", str(ws.root),
                                      "--calibration-low", "0.01", "--calibration-high", "100"])  # fmt: skip
    assert result.exit_code == 0, result.output
    return ws


def screenshots(ws: Workspace, out: Path) -> list[Path]:
    from playwright.sync_api import expect, sync_playwright

    client = mlflow_store.connect(ws)
    experiment = client.get_experiment_by_name("gemflow")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    mv = client.get_model_version_by_alias("gem-ranker", "champion")
    model_id = logged_model_id(mv)
    port = free_port()
    server = start_server(ws.mlflow, port=port, new_session=True, timeout=300)  # a loaded machine: slow start
    url, shots = f"http://127.0.0.1:{port}", []
    out.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            expect.set_options(timeout=TIMEOUT_MS)
            page.goto(ui_link(url, f"/experiments/{experiment.experiment_id}"))
            expect(
                page.get_by_text(re.compile("ranker-fx")).first
            ).to_be_visible()  # the run, in the runs view
            page.wait_for_timeout(3000)  # the assistant panel opens late; then close it
            _close_assistant(page)
            page.wait_for_timeout(1000)
            shots.append(out / "mlflow-model-training-view.png")
            page.screenshot(path=str(shots[-1]))
            page.goto(ui_link(url, f"/experiments/{experiment.experiment_id}/models/{model_id}"))
            expect(page.get_by_text("valid_ne").first).to_be_visible()  # its metrics: the best epoch's
            # "Datasets used": the training set its metrics were measured on (not "None")
            expect(page.get_by_role("button", name=re.compile(r"^fx \(#")).first).to_be_visible()
            page.wait_for_timeout(3000)
            _close_assistant(page)
            page.wait_for_timeout(1000)
            shots.append(out / "mlflow-logged-model.png")
            page.screenshot(path=str(shots[-1]), full_page=True)
            browser.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
    return shots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--keep", type=Path, help="train here (reused when it already holds the run)")
    args = parser.parse_args()
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        ws = Workspace(root / "ws") if (root / "ws" / "models").is_dir() else trained_and_registered(root)
        for path in screenshots(ws, args.out.resolve()):
            print(path)


if __name__ == "__main__":
    main()
