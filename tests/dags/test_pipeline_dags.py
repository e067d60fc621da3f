"""The register -> refresh -> deploy DAGs: wiring (schedules, outlets, trigger rules) in both modes, and real
``dag.test()`` runs in the Airflow environment whose tasks call the project CLI: a refresh that skips without a
champion and publishes EMBEDDINGS with one; a deploy that goes live, and one whose smoke test fails and rolls back."""

from __future__ import annotations

import datetime as dt
import json
import socket
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from features.training_sets import TrainingSetConfig, build_training_set
from gemflow.cli import app
from gemflow.workspace import Workspace
from models.config import RankerConfig, UserModelConfig
from models.inference.bundle import ModelBundle, build_model, save_bundle
from models.training.data import TrainingSet
from models.training.dense import DenseSpec
from tests.dags.airflow_env import DAGS, airflow_env, migrate, require_airflow, run_airflow_python
from tests.features.helpers import DAY0, ads_frame, events_frame, publish_without_gate, users_frame

WIRING = f"""
import json
from airflow.dag_processing.dagbag import BundleDagBag
bag = BundleDagBag(dag_folder={str(DAGS)!r}, bundle_path={str(DAGS)!r})
out = {{"errors": {{k: str(v) for k, v in bag.import_errors.items()}}, "dags": {{}}}}
for dag_id in ("gemflow_register", "gemflow_refresh", "gemflow_deploy", "gemflow_train", "gemflow_ranker"):
    dag = bag.dags[dag_id]
    cond = dag.timetable.asset_condition
    out["dags"][dag_id] = {{
        "schedule": [type(cond).__name__, sorted(a.name for a in cond.objects)],
        "catchup": dag.catchup,
        "params": sorted(dag.params.keys()),
        "param_docs": {{k: dag.params.get_param(k).description for k in dag.params.keys()}},
        "doc": bool(dag.doc_md),
        "tasks": {{
            t.task_id: {{
                "outlets": sorted(o.name for o in t.outlets),
                "upstream": sorted(t.upstream_task_ids),
                "trigger_rule": str(t.trigger_rule.value),
                "operator": type(t).__name__,
                "timeout": t.execution_timeout.total_seconds() if t.execution_timeout else None,
                "retries": t.retries,
                "on_failure": bool(t.on_failure_callback),
                "command": list(t.op_args[0]) if hasattr(t, "op_args") else list(t.arguments),
            }}
            for t in dag.tasks
        }},
    }}
ingest = bag.dags["gemflow_ingest"].get_task("ingest")
out["ingest"] = {{"command": list(ingest.op_args[0]) if hasattr(ingest, "op_args") else list(ingest.arguments)}}
print(json.dumps(out))
"""


def test_pipeline_dags_wiring(tmp_path):
    require_airflow()
    template = tmp_path / "pod-template.yaml"  # cluster mode needs one (tests/dags/test_stage_pods.py)
    template.write_text("apiVersion: v1\nkind: Pod\nspec:\n  containers:\n    - name: base\n")
    for mode, operator in (("local", "PythonOperator"), ("cluster", "StagePodOperator")):
        engine = "spark" if mode == "cluster" else "local"  # the platform's data_engine (gemflow up)
        spark = {  # what the chart's stage settings hold when stages.dataEngine is spark (tests/helm)
            "GEMFLOW_SPARK_CONF": json.dumps(
                {"spark.sql.shuffle.partitions": "24", "spark.executor.instances": "4"}
            ),
            "GEMFLOW_SPARK_POD_TEMPLATE_FILE": str(template),
            "GEMFLOW_SPARK_SERVICE_ACCOUNT": "gemflow-spark",
        }
        env = airflow_env(
            tmp_path, GEMFLOW_MODE=mode, GEMFLOW_POD_TEMPLATE_FILE=str(template), GEMFLOW_DATA_ENGINE=engine,
            **spark,
        )  # fmt: skip
        out = run_airflow_python(WIRING, env)
        assert out["errors"] == {}, out["errors"]
        reg, ref, dep = (out["dags"][d] for d in ("gemflow_register", "gemflow_refresh", "gemflow_deploy"))

        assert reg["schedule"] == ["AssetAll", ["gemflow.user_model"]]
        gate = reg["tasks"]["register_and_gate"]
        assert gate["outlets"] == ["gemflow.champion"] and gate["operator"] == operator
        assert [c for c in gate["command"] if not c.startswith(("{{", "{%"))] == [
            "register-run", "--kind", "--run-dir", "--training-set", "--calibration-low", "--calibration-high",
        ]  # fmt: skip

        assert ref["schedule"] == ["AssetAny", ["gemflow.champion", "gemflow.features"]]
        refresh = ref["tasks"]["refresh_embeddings"]
        assert (
            refresh["outlets"] == ["gemflow.embeddings"] and "--skip-without-champion" in refresh["command"]
        )

        # then the retrieval index the servers map, from the vectors that refresh wrote (same day)
        index = ref["tasks"]["build_retrieval_index"]
        assert index["upstream"] == ["refresh_embeddings"] and index["operator"] == operator
        assert index["command"][0] == "retrieval-index" and "--skip-without-vectors" in index["command"]
        assert any("e.extra.get('day')" in c for c in index["command"]) and index["outlets"] == []
        assert set(ref["tasks"]) == {"refresh_embeddings", "build_retrieval_index"}
        # the run acts on what its event names: the run folder (register), the version (refresh, deploy)
        assert any("e.extra.get('run_dir')" in c for c in gate["command"])
        assert any("e.extra.get('model_uri')" in c for c in refresh["command"])
        assert dep["schedule"] == ["AssetAll", ["gemflow.ranker_champion"]]
        assert any("e.extra.get('model_uri')" in c for c in dep["tasks"]["deploy"]["command"])
        tasks = dep["tasks"]
        assert set(tasks) == {"deploy", "smoke_test", "promote", "roll_back"}
        assert tasks["smoke_test"]["upstream"] == ["deploy"]
        assert tasks["promote"]["upstream"] == tasks["roll_back"]["upstream"] == ["smoke_test"]
        assert tasks["promote"]["trigger_rule"] == "all_success"
        assert tasks["roll_back"]["trigger_rule"] == "one_failed"
        assert tasks["deploy"]["command"][tasks["deploy"]["command"].index("--mode") + 1] == mode
        assert all(t["outlets"] == [] for t in tasks.values()) and reg["catchup"] is ref["catchup"] is False

        train, ranker = out["dags"]["gemflow_train"], out["dags"]["gemflow_ranker"]
        assert train["schedule"] == ["AssetAll", ["gemflow.features"]]
        assert train["tasks"]["build_training_set"]["upstream"] == ["training_due"]  # the trigger rule first
        assert train["tasks"]["train_user_model"]["outlets"] == ["gemflow.user_model"]
        assert ranker["schedule"] == ["AssetAll", ["gemflow.embeddings"]]
        assert [t for t, v in ranker["tasks"].items() if v["outlets"]] == ["register_and_gate"]
        assert ranker["tasks"]["register_and_gate"]["outlets"] == ["gemflow.ranker_champion"]
        assert ranker["tasks"]["backfill_embeddings"]["upstream"] == ["training_due"]
        ingest = out["ingest"]
        for build in (train["tasks"]["build_training_set"], ranker["tasks"]["build_training_set"], ingest):
            command = build["command"]
            assert command[command.index("--set") + 1] == f"engine={engine}"
            if mode == "cluster":  # Spark on Kubernetes: spark-submit in cluster mode runs the same command
                assert command[:4] == [
                    "--master",
                    "k8s://https://kubernetes.default.svc",
                    "--deploy-mode",
                    "cluster",
                ]
                assert "spark.executor.instances=4" in command
                entry = command.index("local:///opt/gemflow/spark_main.py")
                assert command[entry + 1] in ("build-training-set", "ingest")
                assert command[-4:] == ["--set", "spark.master=", "--set", "spark.shuffle_partitions=24"]
        # Airflow as users expect: typed, described params; docs; a timeout and a failure callback per stage
        for d in (reg, ref, dep, train, ranker):
            assert d["doc"] and all(d["param_docs"].values()), d["param_docs"]
            assert all(t["timeout"] and t["on_failure"] for t in d["tasks"].values())
        # registration is retry-safe (a retry reuses the version an attempt registered): retried like any stage
        assert gate["retries"] == 2 and ranker["tasks"]["register_and_gate"]["retries"] == 2


# ----------------------------------------------------------------------------------------------- dag.test runs
DAYS = [DAY0 + dt.timedelta(days=k) for k in range(3)]
USER_CFG = UserModelConfig(d_model=16, num_layers=1, num_heads=2, num_user_tokens=2, max_history=32)

RUN = f"""
import json
from airflow.dag_processing.dagbag import BundleDagBag
from airflow.models.taskinstance import TaskInstance
bag = BundleDagBag(dag_folder={str(DAGS)!r}, bundle_path={str(DAGS)!r})
results = []
for dag_id, conf in RUNS:
    run = bag.dags[dag_id].test(run_conf=conf)
    tasks = {{ti.task_id: str(ti.state) for ti in run.get_task_instances()}}
    results.append({{"state": str(run.state), "tasks": tasks}})
from airflow.models.asset import AssetEvent, AssetModel
from airflow.utils.session import create_session
with create_session() as session:
    published = [n for (n,) in session.query(AssetModel.name).join(AssetEvent, AssetEvent.asset_id == AssetModel.id)]
print(json.dumps({{"runs": results, "published": sorted(published)}}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pipeline_world(root: Path) -> tuple[Workspace, Path, dict[str, Path]]:
    """Accepted days in Feast, a user model (its run folder) and two rankers: one trained against that user
    model's embeddings ("local/u1"), one against another version ("local/u0")."""
    ws = Workspace(root / "ws")
    frames = {
        d: {"users": users_frame(d), "ads": ads_frame(d), "events": events_frame(d, n=40)} for d in DAYS
    }
    publish_without_gate(ws, frames)
    build_training_set(
        ws,
        TrainingSetConfig(
            name="vocab", start=DAYS[0].isoformat(), end=DAYS[-1].isoformat(), join_features=False
        ),
    )
    vocab = TrainingSet(ws.training("vocab")).vocab
    dense = DenseSpec(["quality"], [0.0], [1.0])
    torch.manual_seed(0)
    user = build_model("user", USER_CFG, vocab, 1)
    save_bundle(root / "u1" / "model.pt", ModelBundle("user", user, vocab, dense, 0, "u1", ""))
    rankers, vocab = {}, {**vocab, "country": 16}
    for name, expects in (("good", "local/u1"), ("stale", "local/u0")):
        cfg = RankerConfig(d_model=16, num_layers=1, num_heads=2, num_user_tokens=USER_CFG.num_user_tokens)
        ranker = build_model("ranker", cfg, vocab, 1, USER_CFG.d_model)
        bundle = ModelBundle("ranker", ranker, vocab, dense, USER_CFG.d_model, name, expects)
        save_bundle(root / name / "model.pt", bundle)
        rankers[name] = root / name / "model.pt"
    return ws, root / "u1" / "model.pt", rankers


@pytest.mark.integration
def test_refresh_then_deploy_dags_run_end_to_end(tmp_path):
    require_airflow()
    ws, user_model, rankers = _pipeline_world(tmp_path)
    env = migrate(tmp_path / "airflow")
    env.update(GEMFLOW_HOME=str(ws.root), GEMFLOW_BIN=str(Path(sys.executable).parent / "gemflow"))
    port = _free_port()
    runs = [
        ("gemflow_refresh", {}),  # no champion in the workspace's registry yet: skipped, nothing published
        ("gemflow_refresh", {"model_uri": str(user_model), "nproc": 1}),
        ("gemflow_deploy", {"model_uri": str(rankers["good"]), "port": port}),
        ("gemflow_deploy", {"model_uri": str(rankers["stale"]), "port": port}),
    ]
    try:
        code = f"RUNS = {json.dumps(runs)}\n{RUN}"
        results = run_airflow_python(code, env, timeout=1500)
        _check(ws, rankers, results)
    finally:
        CliRunner().invoke(app, ["undeploy", "-w", str(ws.root)])


def _check(ws: Workspace, rankers: dict[str, Path], results: dict) -> None:
    from serving.rollout.local import ready_detail

    skipped, refreshed, good, stale = results["runs"]
    # only the refresh that ran published EMBEDDINGS; the skipped one (no champion yet) published nothing
    assert results["published"] == ["gemflow.embeddings"], results["published"]
    # nothing refreshed, nothing to index; the click-objective user model writes no retrieval vectors: skipped
    assert skipped == {
        "state": "success",
        "tasks": {"refresh_embeddings": "skipped", "build_retrieval_index": "skipped"},
    }
    assert refreshed == {
        "state": "success",
        "tasks": {"refresh_embeddings": "success", "build_retrieval_index": "skipped"},
    }
    summary = json.loads(next(ws.reports(DAYS[-1]).glob("user_embedding/refresh_summary.json")).read_text())
    assert summary["model_version"] == "local/u1" and summary["online"] == "pushed"

    assert good["state"] == "success", good
    assert good["tasks"] == {"deploy": "success", "smoke_test": "success", "promote": "success",
                             "roll_back": "skipped"}  # fmt: skip
    # the stale ranker expects embeddings of another user model: the smoke test catches it and rolls back
    assert stale["state"] == "failed", stale
    assert stale["tasks"] == {"deploy": "success", "smoke_test": "failed", "promote": "upstream_failed",
                              "roll_back": "success"}  # fmt: skip
    state = json.loads((ws.root / "serving" / "deploy.json").read_text())
    assert (state["model_uri"], state["version"], state["status"]) == (
        str(rankers["good"]),
        "good",
        "promoted",
    )
    live = ready_detail(state["url"])  # the restored server answers, serving the good ranker
    assert live and live["model_version"] == "good" and live["expected_user_model_version"] == "local/u1"
