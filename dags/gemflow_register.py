"""Register the newest trained model and gate it: a new @champion publishes CHAMPION, a rejected one nothing.

``gemflow register-run`` exits 4 when the gate keeps the current champion; the task is then skipped (see
``gemflow_stage.UNCHANGED_EXIT``), a skipped task emits no asset event, so a rejected challenger triggers no
embedding refresh and no deploy. Params: ``kind`` (user | ranker), ``run_dir`` ("" = the newest run under
``<workspace>/models/<kind>/``), ``training_set`` (the held-out data the gate judges on; "" = the run's own).
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import dag
from gemflow_stage import CHAMPION, USER_MODEL, stage_task


@dag(
    dag_id="gemflow_register",
    schedule=[USER_MODEL],
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={
        "kind": "user",
        "run_dir": "",
        "training_set": "",
        "calibration_low": 0.8,
        "calibration_high": 1.25,
    },
    tags=["gemflow", "registry"],
)
def gemflow_register():
    stage_task(
        "register_and_gate",
        "register-run",
        "--kind", "{{ params.kind }}",
        "--run-dir", "{{ params.run_dir }}",
        "--training-set", "{{ params.training_set }}",
        "--calibration-low", "{{ params.calibration_low }}",
        "--calibration-high", "{{ params.calibration_high }}",
        outlets=(CHAMPION,),
        retries=0,  # registering twice would add a second version: a failure needs a look, not a retry
    )  # fmt: skip


gemflow_register()
