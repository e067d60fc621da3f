"""Train the online ranker on point-in-time Feast features with the current embeddings, register and gate it.

Scheduled on EMBEDDINGS. Trigger rule (``gemflow train-due --kind ranker``): train when the embeddings come from
a user-model version the last ranker was not trained against (``user_model_version`` of the event), or when the
last ranker training's data is ``retrain_every_days`` old; never before ``min_days`` days are ingested, nor
once per day of a backfill. Otherwise ``training_due`` is skipped with the reason as its note.

EMBEDDINGS -> training_due -> backfill_embeddings (every earlier ingested day gets the embeddings of the
event's user-model version, so each example joins the embedding that was live at its time) -> build the
training set -> train the ranker -> register + gate (``@champion`` publishes RANKER_CHAMPION with
``{"model", "version", "model_uri"}``, which ``gemflow_deploy`` rolls out) ; the training is recorded.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import Param, dag
from gemflow_spark import data_stage_task
from gemflow_stage import (
    EMBEDDINGS,
    RANKER_CHAMPION,
    RUN,
    Embedded,
    StageSettings,
    event_value,
    gate_params,
    optional_param,
    stage_task,
    trigger_params,
)

E = Embedded.from_env()
WS = StageSettings.from_env().workspace
THROUGH = event_value("day", "params.through")
USER_VERSION = event_value("user_model_version", "''", "last")


@dag(
    dag_id="gemflow_ranker",
    schedule=[EMBEDDINGS],
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={
        "config": optional_param(E.ranker_config, "Ranker training YAML; empty = defaults."),
        "nproc": Param(
            E.nproc, type="integer", minimum=1, maximum=64, description="Embedding backfill workers."
        ),
        **trigger_params(),
        **gate_params(E),
    },
    doc_md=__doc__,
    tags=["gemflow", "ranker"],
)
def gemflow_ranker():
    due = stage_task(
        "training_due", "train-due", "--kind", "ranker", "--through", THROUGH, "--reason-key", USER_VERSION,
        "--min-days", "{{ params.min_days }}",
        "--every-days", "{{ 0 if params.force else params.retrain_every_days }}",
        retries=0, timeout=dt.timedelta(minutes=5),
    )  # fmt: skip
    backfill = stage_task(
        "backfill_embeddings", "backfill-embeddings", "--through", THROUGH,
        "--nproc", "{{ params.nproc }}",
        timeout=dt.timedelta(hours=2),
        doc="Earlier days without the current user model's embeddings are refreshed (offline only).",
    )  # fmt: skip
    build = data_stage_task(
        "build_training_set", "build-training-set", "--name", f"ranker-{RUN}", "--end", THROUGH,
        timeout=dt.timedelta(minutes=30),
    )  # fmt: skip
    train = stage_task(
        "train_ranker", "train", "--model", "ranker", "--training-set", f"ranker-{RUN}",
        "--config", "{{ params.config or '' }}", "--set", f"tracking.run_name=ranker-{RUN}",
        "--resume",  # the folder is this DAG run's own: a retry continues it
        timeout=dt.timedelta(hours=2),
    )  # fmt: skip
    register = stage_task(
        "register_and_gate", "register-run", "--kind", "ranker", "--run-dir", f"{WS}/models/ranker/ranker-{RUN}",
        "--calibration-low", "{{ params.calibration_low }}",
        "--calibration-high", "{{ params.calibration_high }}",
        outlets=(RANKER_CHAMPION,),
        # retried (the default): a retry reuses the version an attempt registered (models.tracking.registry.logging)
        timeout=dt.timedelta(minutes=30),
    )  # fmt: skip
    record = stage_task(
        "record_training", "train-due", "--kind", "ranker", "--through", THROUGH, "--reason-key", USER_VERSION,
        "--record", retries=1, timeout=dt.timedelta(minutes=5),
    )  # fmt: skip
    due >> backfill >> build >> train >> [register, record]


gemflow_ranker()
