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
    for mode in ("local", "cluster"):
        out = run_airflow_python(DAGBAG, airflow_env(tmp_path, GEMFLOW_MODE=mode))
        assert out["errors"] == {}, f"{mode}: {out['errors']}"
        assert {"gemflow_ingest", "gemflow_register", "gemflow_refresh", "gemflow_deploy"} <= set(out["dags"])
        ingest = out["dags"]["gemflow_ingest"]
        assert ingest["tasks"] == ["ingest"]
        assert ingest["outlets"] == ["gemflow.features"]
        assert ingest["catchup"] is False
        assert ingest["timetable"] == "CronDataIntervalTimetable"
