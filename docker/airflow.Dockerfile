# syntax=docker/dockerfile:1.7
# The Airflow image: the official Apache Airflow image, the cncf.kubernetes provider pinned to the version in
# requirements/airflow.lock, and the project's DAGs baked in (no git-sync or DAG volume needed).
#
#   docker build -f docker/airflow.Dockerfile -t gemflow-airflow:0.1.0 .
#
# The DAGs only wire tasks; in cluster mode (GEMFLOW_MODE=cluster) every stage runs in the project image through
# KubernetesPodOperator, so nothing of the ML stack is installed here.
FROM apache/airflow:3.3.2-python3.11
ARG AIRFLOW_VERSION=3.3.2
ARG CNCF_KUBERNETES_PROVIDER=10.25.0
# Pinning apache-airflow in the same command keeps pip from up- or downgrading the base image's Airflow.
RUN pip install --no-cache-dir \
      "apache-airflow==${AIRFLOW_VERSION}" \
      "apache-airflow-providers-cncf-kubernetes==${CNCF_KUBERNETES_PROVIDER}"
COPY --chown=airflow:0 dags/ /opt/airflow/dags/
ENV AIRFLOW__CORE__LOAD_EXAMPLES=False \
    GEMFLOW_MODE=cluster
# The official image's non-root user (uid 50000, gid 0).
USER 50000
