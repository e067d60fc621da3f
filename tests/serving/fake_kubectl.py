"""A stand-in ``kubectl`` for the cluster rollout test: records every call and answers like the API server with
KServe's Knative-mode InferenceService semantics. No cluster runs here; this is the one stand-in the tests use.

State lives in ``$FAKE_KUBECTL_STATE``: ``calls.jsonl`` (every argv), ``objects.json`` (the stored
InferenceServices, their revisions and traffic split), ``pods.json`` (model URI -> URL of a real ``gemflow serve``
the test started for it: what the kubelet would run for a revision of that model).

Semantics kept from KServe: a change of the predictor spec makes a new revision; with ``canaryTrafficPercent``
the new revision gets that share and the last rolled-out revision the rest (the first revision always gets
100 %); patching only the percentage moves the split (100: promoted, 0: rolled back); tag routing gives the
``latest`` and ``prev`` revisions their own URLs in ``status.components.predictor.traffic``. ``status.url``, the
route that splits traffic, answers here with the revision holding the larger share.
Supported: ``apply -f F``, ``wait --for=condition=Ready inferenceservice/N -n NS --timeout=Ts``,
``get inferenceservice N -n NS -o json``, ``patch inferenceservice N -n NS --type merge -p JSON``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import yaml

STATE = Path(os.environ["FAKE_KUBECTL_STATE"])
GROUP = "inferenceservices.serving.kserve.io"


def fail(message: str, code: int = 1):
    print(message, file=sys.stderr)
    raise SystemExit(code)


def load(name: str) -> dict:
    path = STATE / name
    return json.loads(path.read_text()) if path.exists() else {}


def save_objects(objects: dict) -> None:
    (STATE / "objects.json").write_text(json.dumps(objects, indent=1))


def option(args: list[str], flag: str, default: str | None = None) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return default


def model_uri(manifest: dict) -> str:
    args = manifest["spec"]["predictor"]["containers"][0]["args"]
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--set" and i + 1 < len(args) else arg.removeprefix("--set=")
        if value.startswith("model_uri="):
            return value.split("=", 1)[1]
    fail("admission webhook: the predictor container names no model_uri")


def merge(base: dict, patch: dict) -> dict:  # RFC 7386 JSON merge patch
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def reconcile(obj: dict | None, manifest: dict) -> tuple[dict, str]:
    """Store ``manifest`` as KServe would: a new revision when the predictor changes, the traffic split."""
    predictor = {k: v for k, v in manifest["spec"]["predictor"].items() if k != "canaryTrafficPercent"}
    canary = manifest["spec"]["predictor"].get("canaryTrafficPercent")
    if obj is None:
        revision = {
            "name": f"{manifest['metadata']['name']}-predictor-00001",
            "model_uri": model_uri(manifest),
        }
        return {"manifest": manifest, "predictor": predictor, "revisions": [revision], "latest": 0,
                "stable": None, "latest_percent": 100}, "created"  # fmt: skip
    obj = dict(obj, manifest=manifest)
    if predictor != obj["predictor"]:
        # the revision rolled out so far stays behind the canary: the latest if it was promoted, else the stable
        obj["stable"] = obj["latest"] if obj["latest_percent"] == 100 else obj["stable"]
        name = f"{manifest['metadata']['name']}-predictor-{len(obj['revisions']) + 1:05d}"
        obj["revisions"].append({"name": name, "model_uri": model_uri(manifest)})
        obj["latest"], obj["predictor"] = len(obj["revisions"]) - 1, predictor
        obj["latest_percent"] = 100 if canary is None or obj["stable"] is None else canary
        return obj, "configured"
    percent = 100 if canary is None or obj["stable"] is None else canary
    changed = percent != obj["latest_percent"]
    obj["latest_percent"] = percent
    if percent == 100:
        obj["stable"] = None  # promoted: the previous revision leaves the route
    return obj, "configured" if changed else "unchanged"


def pod_url(revision: dict) -> str:
    return load("pods.json").get(revision["model_uri"], "")


def ready(obj: dict) -> bool:
    url = pod_url(obj["revisions"][obj["latest"]])
    container = obj["manifest"]["spec"]["predictor"]["containers"][0]
    probe = container["readinessProbe"]["httpGet"]["path"]
    if not url:
        return False
    try:
        with urllib.request.urlopen(url + probe, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def status(obj: dict) -> dict:
    latest = obj["revisions"][obj["latest"]]
    traffic = [{"revisionName": latest["name"], "percent": obj["latest_percent"], "latestRevision": True}]
    if obj["stable"] is not None and obj["latest_percent"] < 100:
        stable = obj["revisions"][obj["stable"]]
        traffic.append({"revisionName": stable["name"], "percent": 100 - obj["latest_percent"],
                        "latestRevision": False})  # fmt: skip
    tagged = obj["manifest"]["metadata"].get("annotations", {}).get("serving.kserve.io/enable-tag-routing")
    by_name = {r["name"]: r for r in obj["revisions"]}
    for entry, tag in zip(traffic, ("latest", "prev"), strict=False):
        if tagged == "true":
            entry["tag"], entry["url"] = tag, pod_url(by_name[entry["revisionName"]])
    main = max(traffic, key=lambda t: t["percent"])
    is_ready = ready(obj)
    return {
        "url": pod_url(by_name[main["revisionName"]]),
        "conditions": [{"type": "Ready", "status": "True" if is_ready else "False"}],
        "components": {"predictor": {"latestCreatedRevision": latest["name"], "traffic": traffic}},
    }


def named(args: list[str]) -> tuple[str, str]:
    rest = [a for a in args if not a.startswith("-")]
    kind_name = rest[0] if "/" in rest[0] else f"{rest[0]}/{rest[1]}"
    kind, name = kind_name.split("/", 1)
    if kind not in ("inferenceservice", "inferenceservices", "isvc", GROUP):
        fail(f'error: the server doesn\'t have a resource type "{kind}"')
    return name, option(args, "-n", "default")


def main(argv: list[str]) -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "calls.jsonl", "a") as calls:
        calls.write(json.dumps(argv) + "\n")
    if not argv:
        fail("kubectl controls the Kubernetes cluster manager.")
    verb, args = argv[0], argv[1:]
    objects = load("objects.json")
    if verb == "apply":
        manifest = yaml.safe_load(Path(option(args, "-f")).read_text())
        if (manifest.get("apiVersion"), manifest.get("kind")) != (
            "serving.kserve.io/v1beta1",
            "InferenceService",
        ):
            fail(
                f"error: no matches for kind {manifest.get('kind')!r} in version {manifest.get('apiVersion')!r}"
            )
        meta = manifest["metadata"]
        key = f"{meta.get('namespace', 'default')}/{meta['name']}"
        objects[key], outcome = reconcile(objects.get(key), manifest)
        save_objects(objects)
        print(f"inferenceservice.serving.kserve.io/{meta['name']} {outcome}")
        return
    name, namespace = named(args)
    key = f"{namespace}/{name}"
    if key not in objects:
        fail(f'Error from server (NotFound): {GROUP} "{name}" not found')
    obj = objects[key]
    if verb == "get":
        if option(args, "-o") != "json":
            fail("fake kubectl: only -o json is answered")
        print(json.dumps({**obj["manifest"], "status": status(obj)}))
    elif verb == "wait":
        if option(args, "--for") != "condition=Ready":
            fail("fake kubectl: only --for=condition=Ready is answered")
        deadline = time.monotonic() + float(option(args, "--timeout", "30s").rstrip("s"))
        while not ready(obj):
            if time.monotonic() > deadline:
                fail(f"error: timed out waiting for the condition on inferenceservices/{name}")
            time.sleep(0.5)
        print(f"inferenceservice.serving.kserve.io/{name} condition met")
    elif verb == "patch":
        if option(args, "--type") != "merge":
            fail("fake kubectl: custom resources take --type merge (or json), not strategic")
        objects[key], _ = reconcile(obj, merge(obj["manifest"], json.loads(option(args, "-p"))))
        save_objects(objects)
        print(f"inferenceservice.serving.kserve.io/{name} patched")
    else:
        fail(f'error: unknown command "{verb}" for "kubectl"')


if __name__ == "__main__":
    main(sys.argv[1:])
