"""Cluster rollout: the deployer owns the ranker's InferenceService (Knative mode) and drives it with kubectl.

deploy: apply the manifest (``isvc``: the chart's, model pinned, tag routing on so the canary revision has its
own ``latest-`` URL), wait for Ready, hand the smoke test the canary's URL.
promote: canary -> 100 %. roll back: canary -> 0 %: KServe routes everything to the previous ready revision,
which is the deployment this one replaced. The stage pod running this needs rights on ``inferenceservices``.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from serving.rollout.base import Deployment, RolloutError, serving_dir
from serving.rollout.isvc import inference_service


def kubectl(binary: str, *args: str, timeout: float = 660) -> str:
    try:
        proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as err:
        raise RolloutError(f"{binary!r} not found: cluster mode needs kubectl in the stage image") from err
    if proc.returncode:
        raise RolloutError(
            f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}"
        )
    return proc.stdout


def canary_patch(percent: int) -> str:
    return json.dumps({"spec": {"predictor": {"canaryTrafficPercent": percent}}})


def traffic_url(isvc: dict, tag: str) -> str:
    """The URL of the revision carrying ``tag`` ("latest": the canary), else the service's own URL."""
    traffic = isvc.get("status", {}).get("components", {}).get("predictor", {}).get("traffic", [])
    tagged = [t["url"] for t in traffic if t.get("tag") == tag and t.get("url")]
    return tagged[0] if tagged else isvc.get("status", {}).get("url", "")


@dataclass
class ClusterRollout:
    root: Path  # the workspace root (the rendered manifest is kept under serving/)
    overrides: list[str] = field(default_factory=list)  # ServingConfig overrides (namespace, canary %, ...)
    kubectl_bin: str = "kubectl"
    timeout: float = 300.0
    manifest_file: str = ""  # the chart's InferenceService manifest; default: $GEMFLOW_RANKER_MANIFEST_FILE
    mode: str = "cluster"

    def manifest(self, model_uri: str) -> tuple[Path, dict]:
        import yaml

        manifest = inference_service(model_uri, self.overrides, self.manifest_file)
        path = serving_dir(self.root) / "inferenceservice.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(manifest, sort_keys=False))
        return path, manifest

    def deploy(self, model_uri: str, version: str) -> tuple[str, int, str]:
        path, manifest = self.manifest(model_uri)
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        self._kubectl("apply", "-f", str(path))
        self._kubectl("wait", "--for=condition=Ready", f"inferenceservice/{name}", "-n", namespace,
                      f"--timeout={int(self.timeout)}s")  # fmt: skip
        return traffic_url(self._get(name, namespace), "latest"), 0, str(path)

    def is_live(self, dep: Deployment) -> bool:
        return False  # applying the same pinned manifest again is a no-op for KServe anyway

    def promote(self, dep: Deployment) -> None:
        self._patch_canary(dep, 100)

    def roll_back(self, dep: Deployment, target_uri: str, target_version: str) -> tuple[str, int]:
        """Traffic back to the previous revision (``dep.previous_uri``, the only target a canary can return to)."""
        if not dep.previous_uri:
            raise RolloutError(f"{dep.version} is the first revision: there is no earlier one to route to")
        name, namespace = self._patch_canary(dep, 0)
        return self._get(name, namespace).get("status", {}).get("url", ""), 0

    def _patch_canary(self, dep: Deployment, percent: int) -> tuple[str, str]:
        import yaml

        meta = yaml.safe_load(Path(dep.manifest).read_text())["metadata"]
        self._kubectl("patch", "inferenceservice", meta["name"], "-n", meta["namespace"], "--type", "merge",
                      "-p", canary_patch(percent))  # fmt: skip
        return meta["name"], meta["namespace"]

    def _get(self, name: str, namespace: str) -> dict:
        return json.loads(self._kubectl("get", "inferenceservice", name, "-n", namespace, "-o", "json"))

    def _kubectl(self, *args: str) -> str:
        return kubectl(self.kubectl_bin, *args, timeout=self.timeout + 60)
