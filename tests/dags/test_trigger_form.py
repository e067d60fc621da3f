"""Airflow's trigger form works with every DAG's defaults: no field is required and empty (which keeps the Trigger
button disabled), and a run triggered with the defaults renders its optional values away and runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.dags.airflow_env import DAGS, airflow_env, migrate, require_airflow, run_airflow_python

# The form's schema as the UI receives it: the serialized DAG's params, each dumped the way the REST API's
# DAG details do (airflow.api_fastapi.core_api.datamodels.dags: {name: param.dump()}).
FORM = f"""
import json
from airflow.dag_processing.dagbag import BundleDagBag
from airflow.serialization.serialized_objects import DagSerialization
bag = BundleDagBag(dag_folder={str(DAGS)!r}, bundle_path={str(DAGS)!r})
out = {{"errors": {{k: str(v) for k, v in bag.import_errors.items()}}, "forms": {{}}}}
for dag_id, dag in bag.dags.items():
    served = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    out["forms"][dag_id] = {{k: v.dump() for k, v in served.params.items()}}
    served.params.validate()  # what a trigger with the form's defaults is checked against
print(json.dumps(out, default=str))
"""


def required_by_the_form(field: dict) -> bool:
    """The UI's rule (airflow/ui FlexibleForm): a field is required unless its schema type allows null."""
    kind = field["schema"].get("type")
    return bool(kind) and not (isinstance(kind, list) and "null" in kind)


def test_every_trigger_form_can_be_submitted_with_its_defaults(tmp_path):
    require_airflow()
    env = airflow_env(tmp_path, GEMFLOW_LANDING="synthetic", GEMFLOW_START_DATE="2026-03-01")
    out = run_airflow_python(FORM, env)
    assert out["errors"] == {}, out["errors"]
    assert {"gemflow_train", "gemflow_ranker", "gemflow_register", "gemflow_refresh", "gemflow_land"} <= set(
        out["forms"]
    )
    blocking = {
        f"{dag_id}.{name}"
        for dag_id, form in out["forms"].items()
        for name, field in form.items()
        if required_by_the_form(field) and field["value"] in ("", None)
    }
    assert blocking == set(), f"required but empty in the trigger form: {sorted(blocking)}"
    # the params that document "empty = ..." are optional fields, left empty (null) by default
    for dag_id, name in (("gemflow_train", "through"), ("gemflow_ranker", "through"),
                         ("gemflow_train", "config"), ("gemflow_refresh", "date"),
                         ("gemflow_register", "run_dir"), ("gemflow_register", "training_set")):  # fmt: skip
        field = out["forms"][dag_id][name]
        assert not required_by_the_form(field) and field["value"] is None, (dag_id, name, field)


TRIGGER = f"""
import json
from airflow.dag_processing.dagbag import BundleDagBag
bag = BundleDagBag(dag_folder={str(DAGS)!r}, bundle_path={str(DAGS)!r})
dag = bag.dags["gemflow_train"]
run = dag.test(run_conf=dict(dag.params.dump()))  # what the form submits untouched: every default, nulls included
tis = {{ti.task_id: str(ti.state) for ti in run.get_task_instances()}}
print(json.dumps({{"state": str(run.state), "tasks": tis}}))
"""


@pytest.mark.integration  # a real dag.test() whose first task calls the CLI
def test_the_train_dag_triggered_with_the_form_defaults_runs(tmp_path: Path):
    """With every default (``through`` and ``config`` empty) the trigger rule runs on the newest data: in an empty
    workspace it reports that nothing is due and skips the training (a ``--through None`` would fail instead)."""
    require_airflow()
    env = migrate(tmp_path / "airflow")
    env.update(GEMFLOW_HOME=str(tmp_path / "ws"), GEMFLOW_BIN=str(Path(sys.executable).parent / "gemflow"))
    out = run_airflow_python(TRIGGER, env, timeout=600)
    assert out["state"] == "success", out
    assert out["tasks"]["training_due"] == "skipped", out
    assert json.dumps(out).count("failed") == 0
