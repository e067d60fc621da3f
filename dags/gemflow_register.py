"""Register the model its USER_MODEL event names and gate it: a new @champion publishes CHAMPION.

The run registers exactly the run folder and judges on exactly the training set the triggering event names
(``run_dir``, ``training_set``); a run started by hand takes the params (``run_dir`` "" = the newest run under
``<workspace>/models/<kind>/``). ``gemflow register-run`` exits 4 when the gate keeps the current champion: the
task is then skipped with the gate's reason as its note, and a skipped task emits no asset event, so a rejected
challenger triggers no embedding refresh and no deploy. CHAMPION carries ``{"model", "version", "model_uri"}``.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import Param, dag
from gemflow_stage import (
    CHAMPION,
    USER_MODEL,
    Embedded,
    event_value,
    gate_params,
    optional_param,
    stage_task,
)

E = Embedded.from_env()


@dag(
    dag_id="gemflow_register",
    schedule=[USER_MODEL],
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={
        "kind": Param("user", type="string", enum=["user", "ranker"], description="Which model family."),
        "run_dir": optional_param("", "A run folder; empty = the newest of that kind."),
        "training_set": optional_param("", "Held-out data the gate judges on; empty = the run's."),
        **gate_params(E),
    },
    doc_md=__doc__,
    tags=["gemflow", "registry"],
)
def gemflow_register():
    stage_task(
        "register_and_gate",
        "register-run",
        "--kind", "{{ params.kind }}",
        "--run-dir", event_value("run_dir", "params.run_dir", "last"),
        "--training-set", event_value("training_set", "params.training_set", "last"),
        "--calibration-low", "{{ params.calibration_low }}",
        "--calibration-high", "{{ params.calibration_high }}",
        outlets=(CHAMPION,),
        # retried (the default): a retry reuses the version an attempt registered (models.tracking.registry.logging)
        timeout=dt.timedelta(minutes=30),
        doc="@challenger -> gate (NE on the same held-out split, calibration bounds) -> @champion or not.",
    )  # fmt: skip


gemflow_register()
