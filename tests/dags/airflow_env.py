"""Runs Airflow in its own environment (.venv-airflow) for the DAG tests: pins conflict with the ML stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
AIRFLOW_PYTHON = REPO / ".venv-airflow" / "bin" / "python"
DAGS = REPO / "dags"


def airflow_env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "AIRFLOW__"))
    }
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(DAGS),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__UNIT_TEST_MODE="False",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home}/airflow.db",
        GEMFLOW_BIN=str(Path(sys.executable).parent / "gemflow"),
        **extra,
    )
    return env


def require_airflow() -> None:
    if not AIRFLOW_PYTHON.exists():
        pytest.skip(f"the Airflow environment is missing ({AIRFLOW_PYTHON}); run `make setup`")


def run_airflow_python(code: str, env: dict[str, str], timeout: int = 600) -> dict:
    """Run ``code`` in the Airflow interpreter; it must print one JSON object on its last line."""
    proc = subprocess.run(
        [str(AIRFLOW_PYTHON), "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"airflow subprocess failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def migrate(home: Path) -> dict[str, str]:
    env = airflow_env(home)
    airflow = str(AIRFLOW_PYTHON.parent / "airflow")
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    return env
