"""The training DAG (dags/gemflow_train.py) imports in the Airflow environment and wires FEATURES -> (trigger rule)
-> USER_MODEL.

Lives beside the distributed trainer it launches; it runs in the Airflow interpreter like tests/dags.
"""

from __future__ import annotations

from tests.dags.airflow_env import DAGS, airflow_env, require_airflow, run_airflow_python

WIRING = f"""
import json
from airflow.dag_processing.dagbag import BundleDagBag
bag = BundleDagBag(dag_folder={str(DAGS / "gemflow_train.py")!r}, bundle_path={str(DAGS)!r})
dag = bag.dags["gemflow_train"]
train = dag.get_task("train_user_model")
print(json.dumps({{
    "errors": {{k: str(v) for k, v in bag.import_errors.items()}},
    "tasks": sorted(dag.task_ids),
    "upstream": sorted(train.upstream_task_ids),
    "outlets": sorted(o.name for t in dag.tasks for o in t.outlets),
    "timetable": type(dag.timetable).__name__,
    "schedule_assets": sorted(a.name for a in dag.timetable.asset_condition.objects),
    "type": [c.__name__ for c in type(train).__mro__],
    "args": list(getattr(train, "op_args", [[]])[0]) or list(getattr(train, "arguments", [])),
}}))
"""


def test_train_dag_builds_the_set_then_launches_the_distributed_job(tmp_path):
    require_airflow()
    template = tmp_path / "pod-template.yaml"  # cluster mode needs one (tests/dags/test_stage_pods.py)
    template.write_text("apiVersion: v1\nkind: Pod\nspec:\n  containers:\n    - name: base\n")
    for mode, operator in (("local", "PythonOperator"), ("cluster", "KubernetesPodOperator")):
        env = airflow_env(tmp_path / mode, GEMFLOW_MODE=mode, GEMFLOW_POD_TEMPLATE_FILE=str(template))
        out = run_airflow_python(WIRING, env)
        assert out["errors"] == {}, out["errors"]
        # the trigger rule gates the build; the training is recorded for the next rule check
        assert out["tasks"] == ["build_training_set", "record_training", "train_user_model", "training_due"]
        assert out["upstream"] == ["build_training_set"]
        assert out["outlets"] == ["gemflow.user_model"]
        assert out["schedule_assets"] == ["gemflow.features"]
        assert (
            operator in out["type"]
        )  # cluster mode: a KubernetesPodOperator (StagePodOperator maps exit codes)
        args = out["args"]
        assert args[:3] == ["train", "--model", "user"]
        assert args[args.index("--nproc") + 1] == "{{ params.nproc }}"
