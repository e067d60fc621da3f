"""Refresh the cached user embeddings from the champion user model; publishes EMBEDDINGS.

Runs when a champion is promoted (CHAMPION) and after every ingested day (FEATURES), so the embeddings follow
both new models and new events. Each run embeds the users as of the latest accepted day (the refresh is
idempotent per day: it overwrites that day's partition). Before the first champion exists the task is skipped
(``--skip-without-champion`` exits 4), so no EMBEDDINGS event is published.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import dag
from gemflow_stage import CHAMPION, EMBEDDINGS, FEATURES, stage_task


@dag(
    dag_id="gemflow_refresh",
    schedule=(CHAMPION | FEATURES),
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={"model_uri": "models:/gem-user-model@champion", "nproc": 2},
    tags=["gemflow", "embeddings"],
)
def gemflow_refresh():
    stage_task(
        "refresh_embeddings",
        "refresh-embeddings",
        "--model-uri", "{{ params.model_uri }}",
        "--nproc", "{{ params.nproc }}",
        "--skip-without-champion",
        outlets=(EMBEDDINGS,),
    )  # fmt: skip


gemflow_refresh()
