"""The platform's configuration and what its services share: paths, URLs, secrets and the environment.

``PlatformConfig`` is what ``gemflow up --set`` changes; ``PlatformLayout`` derives from it and the workspace
where each service keeps its files, where it answers, and the one environment every service starts with
(``GEMFLOW_PLATFORM_ID`` marker, Airflow's settings, the embedded pipeline's defaults). Starting and stopping
the services is ``gemflow.platform``'s.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gemflow.services import MARKER
from gemflow.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]


@dataclass
class PlatformConfig:
    host: str = "127.0.0.1"  # every service binds here
    airflow_port: int = 8280  # Airflow API server + UI (8080 is the ranker endpoint's)
    mlflow_port: int = 5000
    endpoint_port: int = 8080  # the ranker's KServe endpoint (the deploy DAG's default port)
    events_port: int = 8090  # the live event collector (``gemflow events serve``: POST /v1/events)
    start_events: bool = True  # start the collector beside the ranker endpoint
    airflow_venv: str = ""  # "" = <repo>/.venv-airflow
    parallelism: int = 2  # LocalExecutor task slots (each stage is itself multi-process on 2 cores)
    api_workers: int = 1
    dag_refresh_seconds: int = 30  # how often the DAG processor rescans dags/
    start_timeout: float = 600.0  # per service, until it answers (minutes on 2 busy cores)
    stop_timeout: float = 30.0  # TERM -> KILL grace per process group
    unpause: bool = True  # new DAGs start unpaused: the pipeline runs itself
    deploy_endpoint: bool = True  # start the ranker endpoint when a champion exists
    # the embedded pipeline (what the DAGs default to; see dags/gemflow_stage.Embedded)
    landing: str = "synthetic"  # synthetic: gemflow_land writes each day; external: you land the logs
    # a fresh workspace starts this many days back: train (2 days: the second joins the first day's ad_stats
    # counters, so they vary on train and the ranker keeps them), valid, test
    backfill_days: int = 4
    synthetic_config: str = "configs/embedded-synthetic.yaml"
    user_config: str = "configs/embedded-user.yaml"
    ranker_config: str = "configs/embedded-ranker.yaml"
    nproc: int = 1  # training ranks / refresh workers: one rank per task on 2 cores with 2 task slots
    calibration_low: float = 0.8  # the register gates' bounds: production's unless a config widens them
    calibration_high: float = 1.25
    data_engine: str = "local"  # training sets: local | spark (`make demo ENGINE=spark`)
    extra_env: dict[str, str] = field(default_factory=dict)


def _repo_path(value: str) -> str:
    """A config path relative to the repository (what the YAML says) made absolute; "" stays "" (defaults)."""
    if not value:
        return ""
    path = Path(value)
    return str(path if path.is_absolute() else REPO / path)


class PlatformLayout:
    """Where a platform on ``ws`` keeps its files and answers, and the environment of its services."""

    def __init__(self, ws: Workspace, cfg: PlatformConfig | None = None):
        self.ws = ws
        self.cfg = cfg or PlatformConfig()
        self.dir = ws.root / "platform"
        self.logs = self.dir / "logs"
        self.state_file = self.dir / "state.json"
        self.airflow_home = ws.root / "airflow"
        venv = Path(self.cfg.airflow_venv) if self.cfg.airflow_venv else REPO / ".venv-airflow"
        self.airflow_bin = venv / "bin"
        self.project_bin = Path(sys.executable).parent

    # urls
    @property
    def airflow_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.airflow_port}"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.mlflow_port}"

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.endpoint_port}"

    @property
    def events_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.events_port}"

    # environment
    def _secret(self, name: str) -> str:
        """A secret kept in the workspace, so restarts keep sessions and JWTs valid across components."""
        path = self.dir / "secrets" / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            path.write_text(secrets.token_urlsafe(32))
            path.chmod(0o600)
        return path.read_text().strip()

    def env(self, marker: str) -> dict[str, str]:
        c = self.cfg
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW__", "VIRTUAL_ENV", MARKER))}
        path = os.pathsep.join(
            [str(self.airflow_bin), str(self.project_bin), keep.get("PATH", "/usr/bin:/bin")]
        )
        env = {
            **keep,
            "PATH": path,
            MARKER: marker,
            "GEMFLOW_HOME": str(self.ws.root),
            "GEMFLOW_BIN": str(self.project_bin / "gemflow"),
            "GEMFLOW_MODE": "local",
            "GEMFLOW_ENDPOINT_PORT": str(c.endpoint_port),
            "GEMFLOW_EVENTS_URL": self.events_url,  # where `gemflow land-synthetic --live` posts
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "DO_NOT_TRACK": "true",
            "GX_ANALYTICS_ENABLED": "false",
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # its job runner is 7 idle processes on 2 cores
            "TORCH_EXTENSIONS_DIR": os.environ.get(
                "TORCH_EXTENSIONS_DIR", str(REPO / ".cache/torch_extensions")
            ),
            "AIRFLOW_HOME": str(self.airflow_home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(c.parallelism),
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": str(not c.unpause),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.airflow_home / 'airflow.db'}",
            "AIRFLOW__API__HOST": c.host,
            "AIRFLOW__API__PORT": str(c.airflow_port),
            "AIRFLOW__API__BASE_URL": self.airflow_url,
            "AIRFLOW__API__WORKERS": str(c.api_workers),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.airflow_url}/execution/",
            "AIRFLOW__API_AUTH__JWT_SECRET": self._secret("jwt"),
            "AIRFLOW__API__SECRET_KEY": self._secret("api"),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            # tasks write their "nothing to do" / gate notes through the public API (dags/gemflow_stage.note)
            "GEMFLOW_AIRFLOW_API": self.airflow_url,
            "GEMFLOW_AIRFLOW_PASSWORDS_FILE": str(
                self.airflow_home / "simple_auth_manager_passwords.json.generated"
            ),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": str(c.dag_refresh_seconds),
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            # a task's first call to the execution API timed out at the default 5 s on 2 busy cores
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "60",
        }
        env.update(
            GEMFLOW_LANDING=c.landing,
            GEMFLOW_START_DATE=self.start_date().isoformat(),
            GEMFLOW_SYNTHETIC_CONFIG=_repo_path(c.synthetic_config),
            GEMFLOW_USER_CONFIG=_repo_path(c.user_config),
            GEMFLOW_RANKER_CONFIG=_repo_path(c.ranker_config),
            GEMFLOW_NPROC=str(c.nproc),
            GEMFLOW_CALIBRATION_LOW=str(c.calibration_low),
            GEMFLOW_CALIBRATION_HIGH=str(c.calibration_high),
            GEMFLOW_DATA_ENGINE=c.data_engine,
        )
        env.update(c.extra_env)
        return env

    def start_date(self) -> dt.date:
        """The embedded pipeline's first day, fixed at the first ``up`` of a workspace (``backfill_days`` back)."""
        path = self.dir / "embedded.json"
        if path.exists():
            return dt.date.fromisoformat(json.loads(path.read_text())["start_date"])
        day = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=self.cfg.backfill_days)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"start_date": day.isoformat()}))
        return day
