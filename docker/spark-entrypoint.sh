#!/bin/sh
# The project image as a Spark-on-Kubernetes driver or executor (stages.dataEngine: spark). Spark starts those
# pods with the arguments `driver ...` / `executor` and expects the image's entrypoint to turn them into a JVM,
# as Apache Spark's own image does (resource-managers/kubernetes/docker/.../entrypoint.sh); the pip-installed
# PySpark here ships no such script. Anything else runs the gemflow CLI, the image's usual entrypoint.
set -eu
SPARK_HOME="${SPARK_HOME:-$(/opt/gemflow/bin/python -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')}"
export SPARK_HOME PYSPARK_PYTHON=/opt/gemflow/bin/python
case "${1:-}" in
  driver)
    shift
    exec "$SPARK_HOME/bin/spark-submit" \
      --conf "spark.driver.bindAddress=${SPARK_DRIVER_BIND_ADDRESS}" \
      --conf "spark.executorEnv.SPARK_DRIVER_POD_IP=${SPARK_DRIVER_BIND_ADDRESS}" \
      --deploy-mode client "$@"
    ;;
  executor)
    # Spark passes the executor's JVM options as SPARK_JAVA_OPT_0, _1, ... (in order).
    set --
    i=0
    while eval "[ -n \"\${SPARK_JAVA_OPT_${i}+x}\" ]"; do
      eval "set -- \"\$@\" \"\${SPARK_JAVA_OPT_${i}}\""
      i=$((i + 1))
    done
    exec java "$@" -Xms"${SPARK_EXECUTOR_MEMORY}" -Xmx"${SPARK_EXECUTOR_MEMORY}" -cp "$SPARK_HOME/jars/*" \
      org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
      --driver-url "${SPARK_DRIVER_URL}" --executor-id "${SPARK_EXECUTOR_ID}" --cores "${SPARK_EXECUTOR_CORES}" \
      --app-id "${SPARK_APPLICATION_ID}" --hostname "${SPARK_EXECUTOR_POD_IP}" \
      --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID}" --podName "${SPARK_EXECUTOR_POD_NAME}"
    ;;
  *)
    exec /opt/gemflow/bin/gemflow "$@"
    ;;
esac
