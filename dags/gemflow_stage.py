"""How a DAG task runs one gemflow stage — the only place that knows the two execution modes.

``GEMFLOW_MODE=local`` (default): the task calls the ``gemflow`` CLI of the project environment
(``GEMFLOW_BIN``, default ``<repo>/.venv/bin/gemflow``); Airflow and the ML stack live in separate
interpreters (their pins conflict), so a subprocess is the boundary.
``GEMFLOW_MODE=cluster``: the task runs the same command in the project image with ``KubernetesPodOperator``.
The pod comes from the chart's stage pod template (``GEMFLOW_POD_TEMPLATE_FILE``, rendered into the stage
settings ConfigMap and mounted into every Airflow pod): the least-privilege ServiceAccount, the security context,
a read-only root filesystem with an emptyDir /tmp, resources, the workspace volume and Feast's
``feature_store.yaml``. The operator adds only the image, the command and the pod's name, so one template holds
every setting a stage pod runs with.

Stages signal a rejected data partition with exit code ``GATE_FAILED_EXIT``; the task then fails without
retries (``AirflowFailException``) in both modes (a pod's exit code is read by ``gemflow_pods.StagePodOperator``):
retrying cannot fix bad data. A stage that finds nothing to do (e.g. the gate kept the current champion) exits
``UNCHANGED_EXIT``; the task is then skipped, so its outlets publish no asset event and nothing downstream runs.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from airflow.sdk import Asset, Param
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

# gemflow.exit_codes holds every command's codes; this image lacks the package: tests/dags/test_exit_codes.py
# pins these two to it.
GATE_FAILED_EXIT = 3
UNCHANGED_EXIT = 4

# Assets chain the DAGs: each stage publishes what the next one is scheduled on.
FEATURES = Asset(name="gemflow.features", uri="gemflow://features/ingested")
USER_MODEL = Asset(name="gemflow.user_model", uri="gemflow://models/user")
CHAMPION = Asset(name="gemflow.champion", uri="gemflow://registry/champion")
EMBEDDINGS = Asset(name="gemflow.embeddings", uri="gemflow://features/user_embedding")
RAW_LOGS = Asset(name="gemflow.raw_logs", uri="gemflow://raw/events")
RANKER_CHAMPION = Asset(name="gemflow.ranker_champion", uri="gemflow://registry/ranker_champion")

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Embedded:
    """What ``gemflow up`` sets for the embedded default (env), with defaults that keep a plain import inert.

    ``GEMFLOW_LANDING``: ``synthetic`` = the ``gemflow_land`` DAG writes each day that ends and the ingest
    backfills from ``GEMFLOW_START_DATE``; ``external`` (default) = a deployment lands its own logs, no land DAG,
    no catch-up. The ``GEMFLOW_*_CONFIG`` files and ``GEMFLOW_NPROC`` are the DAG params' defaults (sizes that fit
    the machine); the calibration bounds are the register gate's; ``GEMFLOW_DATA_ENGINE`` the training sets' engine."""

    landing: str
    start_date: dt.datetime
    synthetic_config: str
    user_config: str
    ranker_config: str
    nproc: int
    calibration_low: float
    calibration_high: float
    endpoint_port: int
    data_engine: str = "local"  # the training sets' engine (``engine: local | spark``)

    @classmethod
    def from_env(cls) -> Embedded:
        env = os.environ.get
        landing = env("GEMFLOW_LANDING", "external")
        if landing not in ("synthetic", "external"):
            raise ValueError(f"GEMFLOW_LANDING must be 'synthetic' or 'external', got {landing!r}")
        engine = env("GEMFLOW_DATA_ENGINE", "local")
        if engine not in ("local", "spark"):
            raise ValueError(f"GEMFLOW_DATA_ENGINE must be 'local' or 'spark', got {engine!r}")
        start = dt.date.fromisoformat(env("GEMFLOW_START_DATE", "2026-01-01"))
        return cls(
            landing=landing,
            start_date=dt.datetime(start.year, start.month, start.day, tzinfo=dt.UTC),
            synthetic_config=env(
                "GEMFLOW_SYNTHETIC_CONFIG", str(REPO / "configs" / "embedded-synthetic.yaml")
            ),
            user_config=env("GEMFLOW_USER_CONFIG", ""),
            ranker_config=env("GEMFLOW_RANKER_CONFIG", ""),
            nproc=int(env("GEMFLOW_NPROC", "2")),
            calibration_low=float(env("GEMFLOW_CALIBRATION_LOW", "0.8")),
            calibration_high=float(env("GEMFLOW_CALIBRATION_HIGH", "1.25")),
            endpoint_port=int(env("GEMFLOW_ENDPOINT_PORT", "8080")),
            data_engine=engine,
        )


# a folder-safe name per DAG run (asset-triggered runs have no logical date to key on)
RUN = "{{ dag_run.run_id | replace(':', '-') | replace('+', '-') }}"


def optional_param(default: str, description: str) -> Param:
    """A string param the trigger form may leave empty. Airflow's form marks every field whose schema type does
    not allow null as required, and keeps Trigger disabled while one is empty; an empty field is sent as null.
    Templates read it as ``params.<name> or ''`` (``event_value`` does), so empty drops the flag (``_drop_empty``)."""
    return Param(default or None, type=["null", "string"], description=description)


def trigger_params() -> dict[str, Param]:
    """The trigger rule's params (``gemflow train-due``), shared by the user-model and ranker DAGs."""
    return {
        "through": optional_param("", "Last day to train on (YYYY-MM-DD); empty = newest."),
        "min_days": Param(
            3, type="integer", minimum=3, description="Ingested days needed before a first training."
        ),
        "retrain_every_days": Param(
            1, type="integer", minimum=0, description="Retrain once the data is this old."
        ),
        "force": Param(
            False, type="boolean", description="Train even if the trigger rule says nothing is due."
        ),
    }


def gate_params(embedded: Embedded) -> dict[str, Param]:
    """The register gate's calibration bounds, shared by the register and ranker DAGs."""
    return {
        "calibration_low": Param(
            embedded.calibration_low, type="number", description="Lowest acceptable calibration."
        ),
        "calibration_high": Param(
            embedded.calibration_high, type="number", description="Highest acceptable calibration."
        ),
    }


@dataclass(frozen=True)
class StageSettings:
    mode: str
    gemflow_bin: str
    workspace: str
    image: str
    namespace: str
    service_account: str
    pod_template_file: str

    @classmethod
    def from_env(cls) -> StageSettings:
        repo = Path(__file__).resolve().parents[1]
        mode = os.environ.get("GEMFLOW_MODE", "local")
        if mode not in ("local", "cluster"):
            raise ValueError(f"GEMFLOW_MODE must be 'local' or 'cluster', got {mode!r}")
        pod_template_file = os.environ.get("GEMFLOW_POD_TEMPLATE_FILE", "")
        # Without the template a stage pod would lose its security context, volumes and Feast settings.
        if mode == "cluster" and not Path(pod_template_file).is_file():
            raise ValueError(
                f"GEMFLOW_MODE=cluster needs GEMFLOW_POD_TEMPLATE_FILE, the stage pod template, to name a file; "
                f"got {pod_template_file!r} (the chart's stage settings ConfigMap sets and mounts it)"
            )
        return cls(
            mode=mode,
            gemflow_bin=os.environ.get("GEMFLOW_BIN", str(repo / ".venv" / "bin" / "gemflow")),
            workspace=os.environ.get("GEMFLOW_HOME", str(repo / "workspace")),
            image=os.environ.get("GEMFLOW_IMAGE", "ghcr.io/gemflow/gemflow:0.1.0"),
            namespace=os.environ.get("GEMFLOW_NAMESPACE", "gemflow"),
            service_account=os.environ.get("GEMFLOW_SERVICE_ACCOUNT", "gemflow-stage-runner"),
            pod_template_file=pod_template_file,
        )


def event_value(key: str, default: str, agg: str = "max") -> str:
    """A Jinja expression: ``key`` of the triggering asset events' ``extra`` (aggregated), else ``default``.

    Every downstream DAG acts on what its triggering event names (a day, a run folder, a model version); a run
    started by hand or by time has no such event and takes ``default``, itself a Jinja expression
    (e.g. ``"params.run_dir"``, ``"ds"``). Several events consumed by one run (a backfill) aggregate with
    ``agg``: ``max`` / ``min`` of the values, or ``last``."""
    return (
        "{%- set ns = namespace(v=[]) -%}"
        "{%- if triggering_asset_events is defined -%}"
        "{%- for evs in triggering_asset_events.values() -%}{%- for e in evs -%}"
        f"{{%- if e.extra and e.extra.get({key!r}) is not none -%}}"
        f"{{%- set ns.v = ns.v + [e.extra[{key!r}] | string] -%}}"
        "{%- endif -%}{%- endfor -%}{%- endfor -%}{%- endif -%}"
        f"{{{{ (ns.v | {agg}) if ns.v else (({default}) if ({default}) is not none else '') }}}}"
    )


def _drop_empty(args: list[str]) -> list[str]:
    """Templated optional values left empty go, with their ``--flag``: the command's default applies."""
    out: list[str] = []
    for a in args:
        if a.strip() == "":
            if out and out[-1].startswith("--"):
                out.pop()
            continue
        out.append(a)
    return out


class StageOutput:
    """Relays a stage's output into the task log at each line's own level (not every stderr line as "error")."""

    LEVEL = re.compile(r"^\S*\s?\S*\s?\b(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\b[\s:]")

    PY_WARNING = re.compile(r"\.py:\d+: \w*Warning: ")
    GLOG = re.compile(r"^(?:\[rank\d+\]:)?([IWEF])\d{4} \d\d:\d\d")  # torch's C++ logs: W1201 16:27:58 …

    def __init__(self, name: str):
        self.log = logging.getLogger(f"gemflow.{name}")
        self.in_traceback = False
        self.tail: list[str] = []

    def line(self, raw: str) -> None:
        text = raw.rstrip("\n").split("\r")[-1].rstrip()  # progress bars: keep the last redraw
        if not text:
            return
        self.tail = [*self.tail[-19:], text]
        if text.startswith("Traceback (most recent call last)"):
            self.in_traceback = True
        m = self.LEVEL.match(text[:60])
        glog = self.GLOG.match(text)
        if self.PY_WARNING.search(text):
            level = "WARNING"
        elif glog:
            level = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}[glog.group(1)]
        elif m:
            self.in_traceback = False
            level = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(m.group(1), m.group(1))
        elif self.in_traceback or text.startswith("error:"):
            level = "ERROR"
            if not text.startswith((" ", "\t", "Traceback")):
                self.in_traceback = False  # the exception line ends the traceback
        else:
            level = "INFO"
        self.log.log(getattr(logging, level), "%s", text)


def run_cli(args: list[str], gemflow_bin: str, workspace: str, metadata: dict | None = None) -> None:
    """Run one CLI stage, relaying its output into the task log; attach ``metadata`` to its asset events.

    The stage may add to the metadata: it gets a file name in ``GEMFLOW_EVENT_FILE`` and writes a JSON object
    there (``register-run`` writes the model name and version it registered)."""
    args = _drop_empty(args)
    with tempfile.TemporaryDirectory(prefix="gemflow-event-") as tmp:
        event_file = Path(tmp) / "event.json"
        env = {**os.environ, "GEMFLOW_HOME": workspace, "GEMFLOW_EVENT_FILE": str(event_file)}
        out = StageOutput(args[0] if args else "stage")
        proc = subprocess.Popen(
            [gemflow_bin, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", bufsize=1,
        )  # fmt: skip
        assert proc.stdout is not None
        for raw in proc.stdout:
            out.line(raw)
        code = proc.wait()
        extra = {**(metadata or {})}
        if event_file.exists():
            extra.update(json.loads(event_file.read_text() or "{}"))
    command = f"gemflow {' '.join(args)}"
    if code == GATE_FAILED_EXIT:
        note(f"rejected by the validation gate: {out.tail[-1] if out.tail else command}")
        raise gate_failed(args)
    if code == UNCHANGED_EXIT:
        reason = next((t for t in reversed(out.tail) if t.startswith("nothing to do")), None)
        reason = reason or (out.tail[-1] if out.tail else "nothing to do")
        note(reason if reason.startswith("nothing to do") else f"nothing to do: {reason}")
        raise AirflowSkipException(f"{command}: {reason}")
    if code:
        raise RuntimeError(f"{command} exited with {code}: {out.tail[-1] if out.tail else 'no output'}")
    if extra:
        _attach_metadata(extra)


def note(text: str) -> None:
    """Put ``text`` on the running task instance and its DAG run as their notes (shown in the grid view), so a
    gate rejection or a "nothing to do" is visible at a glance, not a plain green run.

    Notes go through Airflow's public REST API: ``GEMFLOW_AIRFLOW_API`` (its base URL; ``gemflow up`` sets it)
    with ``GEMFLOW_AIRFLOW_USER`` / ``GEMFLOW_AIRFLOW_PASSWORD`` or, for the embedded simple auth manager, the
    generated passwords file (``GEMFLOW_AIRFLOW_PASSWORDS_FILE``). Without them the reason stays in the log only;
    a failed call never fails the task."""
    log = logging.getLogger("gemflow.note")
    log.info("note: %s", text)
    base = os.environ.get("GEMFLOW_AIRFLOW_API", "")
    if not base:
        return
    import urllib.parse
    import urllib.request

    from airflow.sdk import get_current_context

    try:
        ctx = get_current_context()
        user = os.environ.get("GEMFLOW_AIRFLOW_USER", "admin")
        password = os.environ.get("GEMFLOW_AIRFLOW_PASSWORD", "")
        if not password and os.environ.get("GEMFLOW_AIRFLOW_PASSWORDS_FILE"):
            password = json.loads(Path(os.environ["GEMFLOW_AIRFLOW_PASSWORDS_FILE"]).read_text())[user]

        def call(method: str, path: str, body: dict, token: str = "") -> dict:
            req = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(), method=method)
            req.add_header("Content-Type", "application/json")
            if token:
                req.add_header("Authorization", f"Bearer {token}")
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"{}")

        token = call("POST", "/auth/token", {"username": user, "password": password})["access_token"]
        ti = ctx["ti"]
        run = urllib.parse.quote(ti.run_id, safe="")
        short = text[:1000]
        call("PATCH", f"/api/v2/dags/{ti.dag_id}/dagRuns/{run}/taskInstances/{ti.task_id}?update_mask=note",
             {"note": short}, token)  # fmt: skip
        call("PATCH", f"/api/v2/dags/{ti.dag_id}/dagRuns/{run}?update_mask=note",
             {"note": f"{ti.task_id}: {short}"[:1000]}, token)  # fmt: skip
    except Exception as err:  # a note is a convenience: the task's outcome does not depend on it
        log.info("could not set the note through %s: %s", base, err)


def _attach_metadata(extra: dict) -> None:
    """Every outlet of the running task publishes its event with ``extra`` (run id, version, day)."""
    from airflow.sdk import get_current_context

    context = get_current_context()
    extra = {**extra, "dag_run_id": context["run_id"]}
    for outlet in context["task"].outlets:
        context["outlet_events"][outlet].extra.update(extra)


def raw_logs_sensor(day: str = "{{ ds }}"):
    """Waits (rescheduling, not holding a slot) until the raw events partition of ``day`` has landed.

    Local mode only: the workspace is on this machine. A cluster's ingest runs on the landing zone's schedule."""
    s = StageSettings.from_env()
    if s.mode != "local":
        return None
    from airflow.providers.standard.sensors.python import PythonSensor

    return PythonSensor(
        task_id="wait_for_raw_logs",
        python_callable=_raw_landed,
        op_args=[s.workspace, day],
        mode="reschedule",
        poke_interval=30,
        timeout=dt.timedelta(hours=12).total_seconds(),
        doc_md=f"Waits for `raw/events/date=<day>` under the workspace (`{s.workspace}`), rescheduling every 30 s.",
    )


def _raw_landed(workspace: str, day: str) -> bool:
    return (Path(workspace) / "raw" / "events" / f"date={day}").is_dir()


def gate_failed(args: list[str]) -> AirflowFailException:
    """The task failure for a rejected partition: final on its first try, whatever ``retries`` says."""
    return AirflowFailException(f"gemflow {' '.join(args)}: the validation gate rejected the partition")


def notify_failure(context) -> None:
    """Failure callback of every stage task: one clear line in the task log, then the deployment's notifier.

    ``GEMFLOW_FAILURE_NOTIFIER=module:attribute`` names a callable taking the context (an Airflow notifier
    instance works, e.g. one built from the Slack or SMTP provider in a module of the deployment)."""
    ti, dag_run = context["ti"], context["dag_run"]
    err = context.get("exception")
    line = (f"gemflow stage FAILED: dag={ti.dag_id} task={ti.task_id} run={dag_run.run_id} "
            f"try={ti.try_number}: {type(err).__name__ if err else 'failure'}: {err}")  # fmt: skip
    logging.getLogger("gemflow.failure").error(line)
    target = os.environ.get("GEMFLOW_FAILURE_NOTIFIER", "")
    if target:
        import importlib

        module, _, attr = target.partition(":")
        try:
            notifier = getattr(importlib.import_module(module), attr)
            notifier(context)
        except Exception:  # a broken notifier must not hide the failure it reports
            logging.getLogger("gemflow.failure").exception("GEMFLOW_FAILURE_NOTIFIER=%s failed", target)


STAGE_DOC = """Runs `gemflow {command}` ({mode} mode){retry}. Exit 3 (validation gate) fails the task for good;
exit 4 (nothing to do) skips it with the reason in its log and note, and its assets publish no event."""


def stage_task(
    task_id: str,
    *args: str,
    outlets: tuple[Asset, ...] = (),
    retries: int = 2,
    trigger_rule: str = "all_success",
    timeout: dt.timedelta = dt.timedelta(hours=1),
    metadata: dict | None = None,
    doc: str = "",
    pod: dict | None = None,
):
    """An operator running ``gemflow <args>`` (args are Jinja-templated, e.g. ``{{ ds }}``).

    ``retries`` only where a retry can help (a killed or timed-out process; a training resumes from its
    checkpoint); ``timeout`` is the stage's ``execution_timeout``; ``metadata`` (templated) goes on every asset
    event the task publishes; ``pod`` (cluster mode) replaces operator settings of the stage pod (the Spark
    stages: ``gemflow_spark``)."""
    s = StageSettings.from_env()
    retry = f", {retries} retr{'y' if retries == 1 else 'ies'}" if retries else ", no retries"
    common = {
        "task_id": task_id,
        "outlets": list(outlets),
        "retries": retries,
        "retry_delay": dt.timedelta(seconds=30),
        "trigger_rule": trigger_rule,
        "execution_timeout": timeout,
        "on_failure_callback": notify_failure,
        "doc_md": (doc + "\n\n" if doc else "") + STAGE_DOC.format(command=args[0], mode=s.mode, retry=retry),
    }
    if s.mode == "local":
        from airflow.providers.standard.operators.python import PythonOperator

        return PythonOperator(
            python_callable=run_cli,
            op_args=[list(args), s.gemflow_bin, s.workspace],
            op_kwargs={"metadata": dict(metadata or {})},
            **common,
        )

    from gemflow_pods import StagePodOperator

    # Everything else (GEMFLOW_HOME included) comes from the template; values given here would override it.
    settings = {
        "name": f"gemflow-{task_id}".replace("_", "-"),
        "pod_template_file": s.pod_template_file,
        "image": s.image,
        "cmds": ["gemflow"],
        "arguments": list(args),
        "namespace": s.namespace,
        "service_account_name": s.service_account,
        **(pod or {}),
    }
    return StagePodOperator(
        **settings,
        get_logs=True,
        on_finish_action="delete_succeeded_pod",
        skip_on_exit_code=UNCHANGED_EXIT,
        **common,
    )
