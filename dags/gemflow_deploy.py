"""Roll out the ranker its RANKER_CHAMPION event names: deploy -> smoke test -> promote | roll back.

Scheduled on RANKER_CHAMPION (published by ``gemflow_ranker`` when its gate promotes a ranker, which it trains
against the embeddings already online): the run deploys exactly the version the event names (``model_uri``,
``models:/gem-ranker/<version>``); a run started by hand deploys ``params.model_uri``. ``GEMFLOW_MODE`` picks the
deploy mode: ``local`` restarts a background ``gemflow serve`` on ``port`` (``GEMFLOW_ENDPOINT_PORT``, set by
``gemflow up``); ``cluster`` applies the InferenceService with kubectl and moves the Knative canary. A failed
smoke test runs ``rollback-deploy`` and the DAG run ends failed (``promote`` is upstream_failed), which is what
should page someone. A failed deploy step (the model does not load) also triggers the rollback: locally the old
server was already stopped.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import Param, dag
from gemflow_stage import RANKER_CHAMPION, Embedded, StageSettings, event_value, stage_task

MODE = StageSettings.from_env().mode
E = Embedded.from_env()


@dag(
    dag_id="gemflow_deploy",
    schedule=[RANKER_CHAMPION],
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={
        "model_uri": Param(
            "models:/gem-ranker@champion", type="string", description="The ranker to roll out."
        ),
        "port": Param(
            E.endpoint_port, type="integer", minimum=1, maximum=65535, description="Local endpoint port."
        ),
    },
    doc_md=__doc__,
    tags=["gemflow", "serving"],
)
def gemflow_deploy():
    deploy = stage_task(
        "deploy",
        "deploy",
        "--mode",
        MODE,
        "--model-uri",
        event_value("model_uri", "params.model_uri", "last"),
        "--port",
        "{{ params.port }}",
        timeout=dt.timedelta(minutes=15),
    )
    smoke = stage_task(
        "smoke_test", "smoke-test", retries=0, timeout=dt.timedelta(minutes=10)
    )  # a bad model stays bad: roll back now
    promote = stage_task("promote", "promote", "--mode", MODE, timeout=dt.timedelta(minutes=10))
    roll_back = stage_task(
        "roll_back",
        "rollback-deploy",
        "--mode",
        MODE,
        "--port",
        "{{ params.port }}",
        trigger_rule="one_failed",
        timeout=dt.timedelta(minutes=15),
    )
    deploy >> smoke >> [promote, roll_back]


gemflow_deploy()
