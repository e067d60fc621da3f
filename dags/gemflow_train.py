"""Train the GEM user model when new features land — but not once per backfilled day; publishes USER_MODEL.

Trigger rule (``gemflow train-due``, documented in ``gemflow/schedule.py``): a FEATURES event for day D trains
only when at least ``min_days`` days are ingested through D (train + valid + test), no later day has landed yet
(a backfill trains once, on its newest day's event) and the last user-model training used data through a day at
least ``retrain_every_days`` before D. Otherwise the ``training_due`` task is skipped with the reason as its note
and nothing else runs. ``force`` trains anyway.

FEATURES -> training_due -> build this run's training set (days through D) -> distributed training
(``gemflow train --model user --nproc N``; locally N processes through the CLI, on a cluster the same CLI in the
project image) -> USER_MODEL with ``{"run_dir", "training_set", "through"}`` -> record the training. Both names
derive from the DAG run, so a task retry rebuilds the same training set and relaunches the same training run,
which resumes from its latest checkpoint instead of starting over.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import Param, dag
from gemflow_spark import data_stage_task
from gemflow_stage import (
    FEATURES,
    RUN,
    USER_MODEL,
    Embedded,
    StageSettings,
    event_value,
    optional_param,
    stage_task,
    trigger_params,
)

E = Embedded.from_env()
WS = StageSettings.from_env().workspace
THROUGH = event_value("day", "params.through")  # the newest day the triggering FEATURES events name


@dag(
    dag_id="gemflow_train",
    schedule=[FEATURES],
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={
        "nproc": Param(
            E.nproc, type="integer", minimum=1, maximum=64, description="Training ranks (processes)."
        ),
        "config": optional_param(E.user_config, "Training YAML; empty = TrainRunConfig defaults."),
        **trigger_params(),
    },
    doc_md=__doc__,
    tags=["gemflow", "training"],
)
def gemflow_train():
    due = stage_task(
        "training_due", "train-due", "--kind", "user", "--through", THROUGH,
        "--min-days", "{{ params.min_days }}",
        "--every-days", "{{ 0 if params.force else params.retrain_every_days }}",
        retries=0, timeout=dt.timedelta(minutes=5),
        doc="The trigger rule: skipped (with the reason) when no training is due.",
    )  # fmt: skip
    build = data_stage_task(
        "build_training_set", "build-training-set", "--name", f"user-{RUN}", "--end", THROUGH,
        timeout=dt.timedelta(minutes=30),
    )  # fmt: skip
    train = stage_task(
        "train_user_model",
        "train",
        "--model", "user",
        "--training-set", f"user-{RUN}",
        "--nproc", "{{ params.nproc }}",
        "--config", "{{ params.config or '' }}",
        "--set", f"tracking.run_name=user-{RUN}",
        "--resume",  # the folder is this DAG run's own: a retry continues it
        outlets=(USER_MODEL,),
        metadata={"run_dir": f"{WS}/models/user/user-{RUN}", "training_set": f"user-{RUN}", "through": THROUGH},
        timeout=dt.timedelta(hours=3),
        doc="A retry resumes the same run from its latest checkpoint.",
    )  # fmt: skip
    record = stage_task(
        "record_training", "train-due", "--kind", "user", "--through", THROUGH, "--record",
        retries=1, timeout=dt.timedelta(minutes=5),
    )  # fmt: skip
    due >> build >> train >> record


gemflow_train()
