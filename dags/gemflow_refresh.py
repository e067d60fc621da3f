"""Refresh the cached user embeddings from the champion user model; publishes EMBEDDINGS.

Runs when a champion is promoted (CHAMPION: the event's ``model_uri`` pins the version just promoted) and after
every ingested day (FEATURES: the event's ``day`` is the day refreshed), so the embeddings follow both new models
and new events. The refresh is idempotent per day (it overwrites that day's partition). Before the first
champion exists the task is skipped ("nothing to do", ``--skip-without-champion`` exits 4), so no EMBEDDINGS
event is published. EMBEDDINGS carries ``{"day", "user_model_version", "model_uri"}``. Then ``build_retrieval_index``
(``gemflow retrieval-index``) builds the retrieval index from the vectors the refresh wrote, writes it beside them
for the servers to map and tracks it in MLflow (``gemflow-retrieval``); skipped for a user model without a
next-item head (no vectors) and when the refresh itself was skipped.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import Param, dag
from gemflow_stage import CHAMPION, EMBEDDINGS, FEATURES, Embedded, event_value, optional_param, stage_task

E = Embedded.from_env()


@dag(
    dag_id="gemflow_refresh",
    schedule=(CHAMPION | FEATURES),
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={
        "model_uri": Param("models:/gem-user-model@champion", type="string", description="The user model."),
        "date": optional_param("", "Day to refresh (YYYY-MM-DD); empty = the latest."),
        "nproc": Param(E.nproc, type="integer", minimum=1, maximum=64, description="Worker processes."),
    },
    doc_md=__doc__,
    tags=["gemflow", "embeddings"],
)
def gemflow_refresh():
    refresh = stage_task(
        "refresh_embeddings",
        "refresh-embeddings",
        "--model-uri", event_value("model_uri", "params.model_uri", "last"),
        "--date", event_value("day", "params.date"),
        "--nproc", "{{ params.nproc }}",
        "--skip-without-champion",
        outlets=(EMBEDDINGS,),
        timeout=dt.timedelta(hours=1),
    )  # fmt: skip
    # the champion or the ad table changed (FEATURES: a day ingested): the index the servers map, rebuilt
    index = stage_task(
        "build_retrieval_index",
        "retrieval-index",
        "--date", event_value("day", "params.date"),
        "--skip-without-vectors",
        timeout=dt.timedelta(hours=1),
    )  # fmt: skip
    refresh >> index


gemflow_refresh()
