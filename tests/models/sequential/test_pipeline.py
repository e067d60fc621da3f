"""A positive-only log through the whole platform path with no code change: import-sequences -> ingest (the
validation gate, the offline store, Feast) -> build-training-set --split leave-one-out -> gemflow train ->
bench/sequential.py's table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from gemflow.cli import app
from tests.conftest import REPO_ROOT
from tests.models.sequential.fixtures import write_sequence_log

pytestmark = pytest.mark.integration
SMALL = ["optim.epochs=3", "optim.batch_size=32", "optim.lr=0.005", "user_model.max_history=16",
         "sasrec.max_len=16", "next_item.eval_negatives=20"]  # fmt: skip


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_order_only_log_to_the_table(tmp_path):
    ws = str(tmp_path / "ws")
    log, attributes = write_sequence_log(tmp_path / "log", users=200)
    out = _cli(
        "import-sequences", str(log), "--item-attributes", str(attributes), "--workspace", ws, "--no-progress"
    )
    day = json.loads(out)["first_day"]  # an order-only log lands in one day
    _cli("ingest", "--date", day, "--workspace", ws)
    _cli("build-training-set", "--name", "loo", "--split", "leave-one-out", "--set", "join_features=false",
         "--workspace", ws)  # fmt: skip
    sets = [arg for item in SMALL for arg in ("--set", item)]
    trained = _cli("train", "-m", "user", "-t", "loo", "-c", str(REPO_ROOT / "configs" / "sequential.yaml"),
                   "--set", "tracking.enabled=false", *sets, "--workspace", ws)  # fmt: skip
    assert json.loads(trained[trained.index("{") :])["test_hr@10"] > 0.5
    table = tmp_path / "table.json"
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "sequential.py"), "--workspace", ws, "--training-set", "loo",
         "--seeds", "0", "--models", "popularity,sasrec,gemflow", *[f"--set={s}" for s in SMALL],
         "--set=next_item.also_select_metric=mrr",  # each run also keeps its best state on valid sampled MRR
         "--json", str(table), "--docs", str(tmp_path / "results.md")],
        check=True, cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    again = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "sequential.py"), "--workspace", ws, "--training-set", "loo",
         "--seeds", "0", "--models", "sasrec", *[f"--set={s}" for s in SMALL]],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    # a finished run is never overwritten: a one-line error, not a traceback
    assert again.returncode == 1 and "already holds a training run" in again.stderr
    assert "Traceback" not in again.stderr
    summary = json.loads(table.read_text())["summary"]
    assert set(summary["table"]) == {"popularity", "sasrec", "gemflow"}
    gem, pop = summary["table"]["gemflow"], summary["table"]["popularity"]
    assert gem["sampled_hr@10"]["mean"] > pop["sampled_hr@10"]["mean"] + 0.3
    # full ranking both ways: the user's history masked (the published convention) and unmasked
    assert summary["every_seed"]["gemflow > popularity"]["masked_ndcg@10"]
    assert summary["every_seed"]["gemflow > popularity"]["unmasked_ndcg@10"]
    assert gem["epochs_per_seed"] and summary["table"]["sasrec"]["epoch_cap"] == [gem["epoch_cap"][0]]
    assert gem["chosen_on"] == "NDCG@10 (sampled)"  # the checkpoint's selection metric, in words
    # what each row trained as: its width (configs/sequential.yaml: 64 and SASRec's 50), fp32 GEMMs unnamed
    assert (gem["shape"], summary["table"]["sasrec"]["shape"], pop["shape"]) == ("d 64", "d 50", "—")
    # the paired comparison over test users: each run's best state ranked again gives the table's figures
    paired_json = tmp_path / "paired.json"
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "sequential.py"), "--workspace", ws, "--training-set", "loo",
         "--models", "popularity,sasrec,gemflow", *[f"--set={s}" for s in SMALL], "--collect", "--paired",
         "--json", str(paired_json)],
        check=True, cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    paired = json.loads(paired_json.read_text())["paired"]
    for baseline in ("popularity", "sasrec"):
        for key in ("sampled_ndcg@10", "masked_hr@10", "sampled_own_hr@10"):
            gap = gem[key]["mean"] - summary["table"][baseline][key]["mean"]
            assert paired[baseline][key]["diff"] == pytest.approx(gap, abs=1e-9)
            assert (
                paired[baseline][key]["low"] <= paired[baseline][key]["diff"] <= paired[baseline][key]["high"]
            )
    assert (tmp_path / "ws" / "sequential" / "seed0" / "gemflow" / "test_ranks.npz").exists()
    assert gem["also_chosen_on"] == "MRR (sampled)" and "sampled_own" in summary["views"]
    doc = (tmp_path / "results.md").read_text()
    assert (
        "<!-- sequential:loo -->" in doc
        and "| gemflow |" in doc
        and "history masked" in doc
        and "gemflow > sasrec in every seed (" in doc  # every comparison names its budget
        and "| shape | parameters | chosen on valid |" in doc
        and (tmp_path / "img" / "sequential-loo.png").exists()
    )
