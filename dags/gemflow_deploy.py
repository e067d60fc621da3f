"""Roll the ranker champion out once fresh embeddings are online: deploy -> smoke test -> promote | roll back.

Scheduled on EMBEDDINGS only: a promoted champion (user model or ranker) always passes through the refresh DAG
first, so the ranker never goes live before embeddings of the user model it expects are online. ``GEMFLOW_MODE``
picks the deploy mode too: ``local`` restarts a background ``gemflow serve``; ``cluster`` applies the
InferenceService with kubectl and moves the Knative canary. A failed smoke test runs ``rollback-deploy`` and the
DAG run ends failed (``promote`` is upstream_failed), which is what should page someone. A failed deploy step
(the model does not load) also triggers the rollback: locally the old server was already stopped.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import dag
from gemflow_stage import EMBEDDINGS, StageSettings, stage_task

MODE = StageSettings.from_env().mode


@dag(
    dag_id="gemflow_deploy",
    schedule=[EMBEDDINGS],
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={"model_uri": "models:/gem-ranker@champion", "port": 8080},
    tags=["gemflow", "serving"],
)
def gemflow_deploy():
    deploy = stage_task(
        "deploy",
        "deploy",
        "--mode",
        MODE,
        "--model-uri",
        "{{ params.model_uri }}",
        "--port",
        "{{ params.port }}",
    )
    smoke = stage_task("smoke_test", "smoke-test", retries=0)  # a bad model stays bad: roll back now
    promote = stage_task("promote", "promote", "--mode", MODE)
    roll_back = stage_task(
        "roll_back",
        "rollback-deploy",
        "--mode",
        MODE,
        "--port",
        "{{ params.port }}",
        trigger_rule="one_failed",
    )
    deploy >> smoke >> [promote, roll_back]


gemflow_deploy()
