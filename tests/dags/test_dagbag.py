"""Every DAG file imports cleanly in the Airflow environment, and the wiring is what the pipeline expects."""

from __future__ import annotations

from tests.dags.airflow_env import DAGS, airflow_env, require_airflow, run_airflow_python

DAGBAG = f"""
import json
from airflow.dag_processing.dagbag import BundleDagBag  # what the DAG processor uses: the bundle is on sys.path
bag = BundleDagBag(dag_folder={str(DAGS)!r}, bundle_path={str(DAGS)!r})
out = {{"errors": {{k: str(v) for k, v in bag.import_errors.items()}}, "dags": {{}}}}
for dag_id, dag in bag.dags.items():
    out["dags"][dag_id] = {{
        "tasks": sorted(dag.task_ids),
        "outlets": sorted(o.name for t in dag.tasks for o in t.outlets),
        "catchup": dag.catchup,
        "timetable": type(dag.timetable).__name__,
    }}
print(json.dumps(out))
"""


def test_dags_import_without_errors(tmp_path):
    require_airflow()
    # Cluster mode needs the stage pod template (tests/dags/test_stage_pods.py checks the chart's one).
    template = tmp_path / "pod-template.yaml"
    template.write_text("apiVersion: v1\nkind: Pod\nspec:\n  containers:\n    - name: base\n")
    for mode in ("local", "cluster"):
        env = airflow_env(tmp_path, GEMFLOW_MODE=mode, GEMFLOW_POD_TEMPLATE_FILE=str(template))
        out = run_airflow_python(DAGBAG, env)
        assert out["errors"] == {}, f"{mode}: {out['errors']}"
        assert {"gemflow_ingest", "gemflow_train", "gemflow_register", "gemflow_refresh", "gemflow_ranker",
                "gemflow_deploy"} <= set(out["dags"])  # fmt: skip
        assert "gemflow_land" not in out["dags"]  # only on the embedded default (GEMFLOW_LANDING=synthetic)
        ingest = out["dags"]["gemflow_ingest"]
        # locally a sensor waits for the day's raw logs (the workspace is on this machine)
        assert ingest["tasks"] == (["ingest", "wait_for_raw_logs"] if mode == "local" else ["ingest"])
        assert ingest["outlets"] == ["gemflow.features"]
        assert ingest["catchup"] is False
        assert ingest["timetable"] == "CronDataIntervalTimetable"

    env = airflow_env(tmp_path, GEMFLOW_LANDING="synthetic", GEMFLOW_START_DATE="2026-03-01")
    out = run_airflow_python(DAGBAG, env)
    assert out["errors"] == {}, out["errors"]
    assert out["dags"]["gemflow_land"]["outlets"] == ["gemflow.raw_logs"]
    assert out["dags"]["gemflow_land"]["catchup"] is out["dags"]["gemflow_ingest"]["catchup"] is True
