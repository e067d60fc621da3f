"""A partition the validation gate rejects fails its task on the first try, in both modes, although the task has
retries: locally a real ``dag.test()`` run of ``gemflow_ingest`` whose task calls the CLI (exit 3); on a cluster
the stage pod operator's cleanup, given the pod the API server reports for a stage that exited 3, raises the same
non-retryable failure, while any other failed exit stays a retryable error. (Without a cluster the provider's
own cleanup fails on its API calls, which is a retryable error too: so exit 0 and 4, the provider's success and
``skip_on_exit_code`` paths, are not run here.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gemflow.workspace import Workspace
from tests.dags.airflow_env import DAGS, airflow_env, migrate, require_airflow, run_airflow_python
from tests.features.helpers import DAY0, events_frame, write_raw

RUN_REJECTED = f"""
import datetime as dt, json
from airflow.dag_processing.dagbag import BundleDagBag
dag = BundleDagBag(dag_folder={str(DAGS)!r}, bundle_path={str(DAGS)!r}).dags["gemflow_ingest"]
run = dag.test(logical_date=dt.datetime({DAY0.year}, {DAY0.month}, {DAY0.day}, tzinfo=dt.UTC))
ti = run.get_task_instance("ingest")
print(json.dumps({{"run": str(run.state), "state": str(ti.state), "try_number": ti.try_number,
                  "retries": dag.get_task("ingest").retries}}))
"""

POD_OUTCOMES = f"""
import json
from airflow.dag_processing.dagbag import BundleDagBag
from airflow.sdk.exceptions import AirflowFailException
from kubernetes.client import models as k8s

bag = BundleDagBag(dag_folder={str(DAGS)!r}, bundle_path={str(DAGS)!r})
task = bag.dags["gemflow_ingest"].get_task("ingest")
pod = task.build_pod_request_obj(dry_run=True)


def reported(exit_code):  # a finished stage pod as the API server reports it
    state = k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=exit_code))
    status = k8s.V1ContainerStatus(name=task.base_container_name, state=state, ready=False, restart_count=0,
                                   image="gemflow", image_id="")
    phase = "Succeeded" if exit_code == 0 else "Failed"
    return k8s.V1Pod(metadata=pod.metadata, status=k8s.V1PodStatus(phase=phase, container_statuses=[status]))


out = {{"operator": type(task).__name__, "retries": task.retries}}
for code in (1, 3):
    try:
        task.cleanup(pod, reported(code))
        out[code] = "success"
    except AirflowFailException as err:
        out[code] = "fail-without-retry: " + str(err)
    except Exception as err:
        out[code] = "retryable: " + type(err).__name__
print(json.dumps(out))
"""


@pytest.mark.integration  # a real dag.test() calling the CLI
def test_a_rejected_partition_fails_the_local_task_on_its_first_try(tmp_path: Path):
    require_airflow()
    ws = Workspace(tmp_path / "ws")
    events = events_frame(DAY0, n=40)
    events.loc[events.index[:10], "surface"] = "billboard"  # 25% bad rows: above the gate's 5%
    write_raw(ws, DAY0, events)
    env = migrate(tmp_path / "airflow")
    env.update(GEMFLOW_HOME=str(ws.root), GEMFLOW_BIN=str(Path(sys.executable).parent / "gemflow"))

    out = run_airflow_python(RUN_REJECTED, env, timeout=600)
    assert out == {"run": "failed", "state": "failed", "try_number": 1, "retries": 2}
    assert ws.quarantine("events", DAY0).exists()  # it was the gate, not a crash


def test_a_rejected_partition_fails_the_stage_pod_without_retries(tmp_path: Path):
    require_airflow()
    template = tmp_path / "pod-template.yaml"
    template.write_text("apiVersion: v1\nkind: Pod\nspec:\n  containers:\n    - name: base\n")
    env = airflow_env(tmp_path, GEMFLOW_MODE="cluster", GEMFLOW_POD_TEMPLATE_FILE=str(template))
    out = run_airflow_python(POD_OUTCOMES, env)
    assert out["operator"] == "StagePodOperator" and out["retries"] == 2
    assert out["3"].startswith("fail-without-retry") and "validation gate rejected" in out["3"], out["3"]
    assert out["1"].startswith("retryable"), out["1"]
