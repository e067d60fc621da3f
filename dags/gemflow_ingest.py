"""Daily ingestion: validate the day's raw event logs, publish them to the offline store and Feast.

The run for logical date D ingests partition D (a data-interval timetable: the run starts once D has ended).
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import dag
from airflow.timetables.interval import CronDataIntervalTimetable
from gemflow_stage import FEATURES, stage_task


@dag(
    dag_id="gemflow_ingest",
    schedule=CronDataIntervalTimetable("@daily", timezone="UTC"),
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    tags=["gemflow", "features"],
)
def gemflow_ingest():
    stage_task("ingest", "ingest", "--date", "{{ ds }}", outlets=(FEATURES,))


gemflow_ingest()
