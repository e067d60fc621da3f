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

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from airflow.sdk import Asset
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


def run_cli(args: list[str], gemflow_bin: str, workspace: str) -> None:
    """Run one CLI stage, streaming its output into the task log."""
    env = {**os.environ, "GEMFLOW_HOME": workspace}
    proc = subprocess.run([gemflow_bin, *args], env=env, check=False)
    if proc.returncode == GATE_FAILED_EXIT:
        raise gate_failed(args)
    if proc.returncode == UNCHANGED_EXIT:
        raise AirflowSkipException(f"gemflow {' '.join(args)}: nothing changed")
    if proc.returncode:
        raise RuntimeError(f"gemflow {' '.join(args)} exited with {proc.returncode}")


def gate_failed(args: list[str]) -> AirflowFailException:
    """The task failure for a rejected partition: final on its first try, whatever ``retries`` says."""
    return AirflowFailException(f"gemflow {' '.join(args)}: the validation gate rejected the partition")


def stage_task(
    task_id: str,
    *args: str,
    outlets: tuple[Asset, ...] = (),
    retries: int = 2,
    trigger_rule: str = "all_success",
):
    """An operator running ``gemflow <args>`` (args are Jinja-templated, e.g. ``{{ ds }}``)."""
    s = StageSettings.from_env()
    common = {"task_id": task_id, "outlets": list(outlets), "retries": retries, "trigger_rule": trigger_rule}
    if s.mode == "local":
        from airflow.providers.standard.operators.python import PythonOperator

        return PythonOperator(
            python_callable=run_cli, op_args=[list(args), s.gemflow_bin, s.workspace], **common
        )

    from gemflow_pods import StagePodOperator

    # Everything else (GEMFLOW_HOME included) comes from the template; values given here would override it.
    return StagePodOperator(
        name=f"gemflow-{task_id}".replace("_", "-"),
        pod_template_file=s.pod_template_file,
        image=s.image,
        cmds=["gemflow"],
        arguments=list(args),
        namespace=s.namespace,
        service_account_name=s.service_account,
        get_logs=True,
        on_finish_action="delete_succeeded_pod",
        skip_on_exit_code=UNCHANGED_EXIT,
        **common,
    )
