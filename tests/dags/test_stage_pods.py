"""In cluster mode every DAG task builds its stage pod from the chart's pod template: the pods that
KubernetesPodOperator would submit (``build_pod_request_obj``, no cluster) run least privilege, with resources,
the workspace volume and Feast's feature_store.yaml."""

from __future__ import annotations

import json

import pytest

from tests.dags.airflow_env import DAGS, airflow_env, require_airflow, run_airflow_python
from tests.helm.render import NAMESPACE, HelmMissing, copy_without_airflow, render

pytestmark = pytest.mark.integration  # helm and the Airflow environment

K8S_VERSION = "1.33.0"

BUILD_PODS = f"""
import json
from airflow.dag_processing.dagbag import BundleDagBag
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from kubernetes.client import ApiClient

bag = BundleDagBag(dag_folder={str(DAGS)!r}, bundle_path={str(DAGS)!r})
pods = {{}}
for dag_id, dag in sorted(bag.dags.items()):
    for task in dag.tasks:
        assert isinstance(task, KubernetesPodOperator), (dag_id, task.task_id, type(task).__name__)
        pod = task.build_pod_request_obj(dry_run=True)
        pods[f"{{dag_id}}.{{task.task_id}}"] = ApiClient().sanitize_for_serialization(pod)
print(json.dumps({{"errors": {{k: str(v) for k, v in bag.import_errors.items()}}, "pods": pods}}))
"""


@pytest.fixture(scope="module")
def stage_pods(tmp_path_factory):
    """Render the trial chart, give the DAGs the stage settings ConfigMap as Airflow would (env + mounted file),
    and build every task's pod in the Airflow environment."""
    require_airflow()
    work = tmp_path_factory.mktemp("stage")
    try:
        docs = render(copy_without_airflow(work), "values-trial.yaml")
    except HelmMissing as err:
        pytest.skip(str(err))
    (settings,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gemflow-stage-settings"
    ]
    template = work / "pod-template.yaml"
    template.write_text(settings["data"]["pod-template.yaml"])
    env = {k: v for k, v in settings["data"].items() if k.isupper()}  # what extraEnvFrom passes
    env["GEMFLOW_POD_TEMPLATE_FILE"] = str(template)  # the chart mounts the same file at its own path
    out = run_airflow_python(BUILD_PODS, airflow_env(work / "airflow", **env))
    assert out["errors"] == {}
    return docs, settings["data"], out["pods"]


def test_every_task_is_a_stage_pod(stage_pods):
    _, _, pods = stage_pods
    assert {"gemflow_ingest.ingest", "gemflow_train.train_user_model", "gemflow_deploy.smoke_test"} <= set(
        pods
    )


def test_stage_pods_run_least_privilege(stage_pods):
    docs, settings, pods = stage_pods
    runner = next(
        d
        for d in docs
        if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == settings["GEMFLOW_SERVICE_ACCOUNT"]
    )
    assert runner["automountServiceAccountToken"] is False
    bound = {s["name"] for d in docs if d["kind"] == "RoleBinding" for s in d["subjects"]}
    assert runner["metadata"]["name"] not in bound, "stage pods need no Kubernetes API access"
    for task, pod in pods.items():
        spec = pod["spec"]
        assert pod["metadata"]["namespace"] == NAMESPACE
        assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "stage", task
        assert spec["serviceAccountName"] == runner["metadata"]["name"], task
        assert spec["automountServiceAccountToken"] is False, task
        assert spec["securityContext"]["runAsNonRoot"] is True, task
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, task
        (c,) = spec["containers"]
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, task
        assert sc["capabilities"] == {"drop": ["ALL"]}, task
        empty_dirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        assert {m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp"} <= empty_dirs, task
        assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), task
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][part]), f"{task}: resources.{part}"


def test_stage_pods_run_the_stage_on_the_shared_workspace_and_store(stage_pods):
    docs, settings, pods = stage_pods
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")["metadata"]["name"]
    feast_cm = next(d for d in docs if d["kind"] == "ConfigMap" and "feature_store.yaml" in d["data"])
    for task, pod in pods.items():
        spec = pod["spec"]
        (c,) = spec["containers"]
        assert c["name"] == "base" and c["image"] == settings["GEMFLOW_IMAGE"], task
        assert c["command"] == ["gemflow"] and c["args"], task
        env = {e["name"]: e for e in c["env"]}
        assert len(env) == len(c["env"]), f"{task}: duplicate environment variables"
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        workspace = env["GEMFLOW_HOME"]["value"]
        assert volumes[mounts[workspace]]["persistentVolumeClaim"]["claimName"] == pvc, task
        store_yaml = env["GEMFLOW_FEATURE_STORE_YAML"]["value"]
        folder = store_yaml.rsplit("/", 1)[0]
        assert volumes[mounts[folder]]["configMap"]["name"] == feast_cm["metadata"]["name"], task
        assert env["MLFLOW_TRACKING_URI"]["value"] == settings["GEMFLOW_MLFLOW_TRACKING_URI"], task
        for name, key in (("MLFLOW_TRACKING_USERNAME", "username"), ("MLFLOW_TRACKING_PASSWORD", "password")):
            # the MLflow login survives KubernetesPodOperator's merge of the template, still from the Secret
            assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "gemflow-mlflow-auth", "key": key}, task
        assert "secretKeyRef" in env["AWS_SECRET_ACCESS_KEY"]["valueFrom"], task  # object storage settings
    ingest = pods["gemflow_ingest.ingest"]["spec"]["containers"][0]
    # templated at run time; the data engine (stages.dataEngine, local by default) picked per stage
    assert ingest["args"] == ["ingest", "--date", "{{ ds }}", "--set", "engine=local"]


def test_stage_pods_validate_strictly(stage_pods):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate==1.37.0")
    _, _, pods = stage_pods
    for pod in pods.values():
        kv.validate(pod, K8S_VERSION, strict=True)


def test_cluster_mode_without_the_pod_template_is_an_import_error(tmp_path):
    require_airflow()
    code = f"""
import json
from airflow.dag_processing.dagbag import BundleDagBag
bag = BundleDagBag(dag_folder={str(DAGS)!r}, bundle_path={str(DAGS)!r})
print(json.dumps({{k: str(v) for k, v in bag.import_errors.items()}}))
"""
    missing = str(tmp_path / "no-such-template.yaml")
    errors = run_airflow_python(
        code, airflow_env(tmp_path, GEMFLOW_MODE="cluster", GEMFLOW_POD_TEMPLATE_FILE=missing)
    )
    assert errors and all("GEMFLOW_POD_TEMPLATE_FILE" in e and missing in e for e in errors.values()), (
        json.dumps(errors)
    )
