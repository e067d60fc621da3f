"""Daily ingestion: validate the day's raw event logs, publish them to the offline store and Feast.

The run for logical date D ingests partition D (a data-interval timetable: the run starts once D has ended),
after a sensor has seen the raw partition land (rescheduling, so a late day does not hold a worker or burn
retries). The gate and the offline writes run on the deployment's data engine (``gemflow_spark``). Publishes FEATURES with ``{"day": D}``: the training and refresh DAGs act on that day.
On the embedded default (``GEMFLOW_LANDING=synthetic``) the DAG catches up from ``GEMFLOW_START_DATE``, in step
with ``gemflow_land``; otherwise it runs from the day it is deployed (``catchup=False``).
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import dag
from airflow.timetables.interval import CronDataIntervalTimetable
from gemflow_spark import data_stage_task
from gemflow_stage import FEATURES, Embedded, raw_logs_sensor

E = Embedded.from_env()


@dag(
    dag_id="gemflow_ingest",
    schedule=CronDataIntervalTimetable("@daily", timezone="UTC"),
    start_date=E.start_date,
    catchup=E.landing == "synthetic",
    max_active_runs=1,
    doc_md=__doc__,
    tags=["gemflow", "features"],
)
def gemflow_ingest():
    ingest = data_stage_task(
        "ingest", "ingest", "--date", "{{ ds }}",
        outlets=(FEATURES,),
        metadata={"day": "{{ ds }}"},
        timeout=dt.timedelta(minutes=30),
        doc="Validation gate (bad rows quarantined; exit 3 = rejected partition, no retry) -> offline store -> Feast.",
    )  # fmt: skip
    sensor = raw_logs_sensor()
    if sensor is not None:
        sensor >> ingest


gemflow_ingest()
