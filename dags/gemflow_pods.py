"""The stage pod operator: ``KubernetesPodOperator`` reading a stage's exit code as the local runner does.

The provider maps ``skip_on_exit_code`` (``UNCHANGED_EXIT``) to a skip, but any other failed pod to a plain
error that Airflow retries; a rejected partition (``GATE_FAILED_EXIT``) must fail for good on its first try, as
``gemflow_stage.run_cli`` makes it locally. Imported only in cluster mode (the provider import is heavy).
"""

from __future__ import annotations

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk.exceptions import AirflowSkipException
from gemflow_stage import GATE_FAILED_EXIT, gate_failed


def container_exit_code(remote_pod, container: str) -> int | None:
    """The exit code of ``container`` in the pod the API server reported, None while it has not terminated."""
    statuses = (remote_pod.status.container_statuses if remote_pod and remote_pod.status else None) or []
    status = next((s for s in statuses if s.name == container), None)
    terminated = status.state.terminated if status and status.state else None
    return terminated.exit_code if terminated else None


class StagePodOperator(KubernetesPodOperator):
    def cleanup(self, pod, remote_pod, xcom_result=None, context=None) -> None:
        try:
            super().cleanup(pod, remote_pod, xcom_result, context)
        except AirflowSkipException:
            raise
        except Exception as err:
            if container_exit_code(remote_pod, self.base_container_name) == GATE_FAILED_EXIT:
                raise gate_failed(list(self.arguments)) from err
            raise
