"""Land the day that just ended as raw event logs — the embedded default's stand-in for a real landing zone.

Defined only when ``GEMFLOW_LANDING=synthetic`` (``gemflow up`` sets it): each ``@daily`` run writes the raw
partition of its data interval's day (``gemflow land-synthetic``: users, ads, events; the same day is the same
file whenever it is landed), backfilling from ``GEMFLOW_START_DATE``. ``gemflow_ingest`` waits for that
partition with a sensor. A real deployment sets ``GEMFLOW_LANDING=external`` and lands its own logs.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import dag
from airflow.timetables.interval import CronDataIntervalTimetable
from gemflow_stage import RAW_LOGS, Embedded, optional_param, stage_task

E = Embedded.from_env()

if E.landing == "synthetic":

    @dag(
        dag_id="gemflow_land",
        schedule=CronDataIntervalTimetable("@daily", timezone="UTC"),
        start_date=E.start_date,
        catchup=True,  # a fresh platform lands its first days at once
        max_active_runs=1,
        params={
            "config": optional_param(E.synthetic_config, "SyntheticConfig YAML (sizes); empty = defaults."),
        },
        doc_md=__doc__,
        tags=["gemflow", "landing"],
    )
    def gemflow_land():
        stage_task(
            "land_synthetic_logs",
            "land-synthetic",
            "--date", "{{ ds }}",
            "--epoch", E.start_date.date().isoformat(),
            "--config", "{{ params.config or '' }}",
            outlets=(RAW_LOGS,),
            metadata={"day": "{{ ds }}"},
            retries=1,
            timeout=dt.timedelta(minutes=20),
            doc="Writes `raw/{users,ads,events}/date=<ds>`; idempotent (same seed, same day, same files).",
        )  # fmt: skip

    gemflow_land()
