"""Train the GEM user model when new features land; publishes USER_MODEL (the register DAG gates it).

FEATURES -> build this run's training set -> distributed training (``gemflow train --model user --nproc N``:
DeepSpeed + torchrec ranks; locally N processes through the CLI, on a cluster the same CLI in the project
image) -> USER_MODEL. Both names derive from the DAG run, so a task retry rebuilds the same training set and
relaunches the same training run, which resumes from its latest checkpoint instead of starting over.
Params: ``nproc`` (ranks) and ``config`` (a training YAML; "" = the defaults of ``TrainRunConfig``).
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import dag
from gemflow_stage import FEATURES, USER_MODEL, stage_task

# a folder-safe name per DAG run (asset-triggered runs have no logical date to key on)
RUN = "{{ dag_run.run_id | replace(':', '-') | replace('+', '-') }}"


@dag(
    dag_id="gemflow_train",
    schedule=[FEATURES],
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={"nproc": 2, "config": ""},
    tags=["gemflow", "training"],
)
def gemflow_train():
    build = stage_task("build_training_set", "build-training-set", "--name", f"user-{RUN}")
    train = stage_task(
        "train_user_model",
        "train",
        "--model", "user",
        "--training-set", f"user-{RUN}",
        "--nproc", "{{ params.nproc }}",
        "--config", "{{ params.config }}",
        "--set", f"tracking.run_name=user-{RUN}",
        outlets=(USER_MODEL,),
    )  # fmt: skip
    build >> train


gemflow_train()
