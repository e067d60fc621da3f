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
        assert {"gemflow_ingest", "gemflow_register", "gemflow_refresh", "gemflow_deploy"} <= set(out["dags"])
        ingest = out["dags"]["gemflow_ingest"]
        assert ingest["tasks"] == ["ingest"]
        assert ingest["outlets"] == ["gemflow.features"]
        assert ingest["catchup"] is False
        assert ingest["timetable"] == "CronDataIntervalTimetable"
