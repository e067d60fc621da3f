"""The data plane's stages (ingest, build_training_set) on the chosen engine (``GEMFLOW_DATA_ENGINE``).

``local`` engine, or local mode: the stage as any other (``gemflow_stage.stage_task``) with ``--set engine=...``
(``spark`` then runs PySpark ``local[*]`` inside the stage's process). Cluster mode with ``spark``: the stage pod
runs ``spark-submit --deploy-mode cluster`` (Spark on Kubernetes): a driver pod runs the same ``gemflow``
command (``/opt/gemflow/spark_main.py``) and starts executor pods. What the chart renders for it comes from the
stage settings (``templates/spark.yaml``, ``gemflow.sparkConf``): ``GEMFLOW_SPARK_CONF`` (image, service account,
pod templates, sizing: spark-submit ``--conf`` pairs), ``GEMFLOW_SPARK_POD_TEMPLATE_FILE`` (the submitting pod:
the Spark service account, with its API token), ``GEMFLOW_SPARK_SERVICE_ACCOUNT``.

spark-submit reports a failed driver as a failed pod, not the stage's exit code: in this mode a rejected
partition (exit 3) fails the task like any other error (the driver's log says why).
"""

from __future__ import annotations

import json
import os

from gemflow_stage import Embedded, StageSettings, stage_task

K8S_MASTER = "k8s://https://kubernetes.default.svc"
SPARK_SUBMIT = "/opt/gemflow/bin/spark-submit"
SPARK_ENTRY = "local:///opt/gemflow/spark_main.py"  # the gemflow CLI (docker/project.Dockerfile)


def spark_env() -> tuple[dict[str, str], str, str]:
    """The chart's Spark settings (conf pairs, submitting pod template, service account); a clear error if unset."""
    names = ("GEMFLOW_SPARK_CONF", "GEMFLOW_SPARK_POD_TEMPLATE_FILE", "GEMFLOW_SPARK_SERVICE_ACCOUNT")
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        raise ValueError(
            f"GEMFLOW_DATA_ENGINE=spark in cluster mode needs {missing} (the chart's stage settings render them "
            "when stages.dataEngine is spark)"
        )
    conf = json.loads(os.environ["GEMFLOW_SPARK_CONF"])
    return conf, os.environ["GEMFLOW_SPARK_POD_TEMPLATE_FILE"], os.environ["GEMFLOW_SPARK_SERVICE_ACCOUNT"]


def spark_submit(task_id: str, conf: dict[str, str], args: list[str]) -> list[str]:
    """spark-submit's arguments: cluster mode on this cluster, the chart's settings, then the gemflow command
    on the Spark engine (the session joins what spark-submit set up: empty master, the chart's partitions)."""
    pairs = [item for key in sorted(conf) for item in ("--conf", f"{key}={conf[key]}")]
    session = [
        "--set",
        "spark.master=",
        "--set",
        f"spark.shuffle_partitions={conf['spark.sql.shuffle.partitions']}",
    ]
    name = f"gemflow-{task_id}".replace("_", "-")
    return [
        "--master", K8S_MASTER, "--deploy-mode", "cluster", "--name", name, *pairs,
        SPARK_ENTRY, *args, "--set", "engine=spark", *session,
    ]  # fmt: skip


def data_stage_task(task_id: str, *args: str, **kwargs):
    """``stage_task`` for a data-plane stage, on the engine the deployment chose."""
    engine = Embedded.from_env().data_engine
    if StageSettings.from_env().mode != "cluster" or engine != "spark":
        return stage_task(task_id, *args, "--set", f"engine={engine}", **kwargs)
    conf, template, account = spark_env()
    pod = {
        "cmds": [SPARK_SUBMIT],
        "arguments": spark_submit(task_id, conf, list(args)),
        "pod_template_file": template,
        "service_account_name": account,
    }
    return stage_task(task_id, *args, pod=pod, **kwargs)
