# syntax=docker/dockerfile:1.7
# The project image: the `gemflow` CLI and every stage (ingest, training, embedding refresh, serving), plus the
# MLflow tracking server and the Feast feature server, which ship in the same pinned environment.
#
#   docker build -f docker/project.Dockerfile -t gemflow:0.1.0-cpu .
#   docker build -f docker/project.Dockerfile --build-arg VARIANT=cuda -t gemflow:0.1.0-cuda .
#
# VARIANT=cpu installs requirements/project.lock as is (torch +cpu, fbgemm-gpu-cpu). VARIANT=cuda installs torch
# and fbgemm-gpu from the PyTorch CUDA index WITH their dependencies (the nvidia-* runtime wheels bring CUDA, so
# the base stays a slim Python image; the node's driver comes from the GPU operator), then the rest of the lock.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG FBGEMM_VERSION=1.8.0
ARG CUDA_CHANNEL=cu130
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/gemflow && /opt/gemflow/bin/pip install --no-cache-dir pip==25.3
COPY requirements/project.lock requirements/project.lock
COPY docker/cluster-extras.txt docker/cluster-extras.txt
# The torch line decides the variant; everything else is the same exact lock, installed without a resolver.
RUN case "${VARIANT}" in \
      cpu)  cp requirements/project.lock /tmp/lock.txt \
            && /opt/gemflow/bin/pip install --no-cache-dir --no-deps \
                 --extra-index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}+cpu" ;; \
      cuda) grep -v -E '^(torch|fbgemm[-_]gpu[-_]cpu|triton)==' requirements/project.lock > /tmp/lock.txt \
            && /opt/gemflow/bin/pip install --no-cache-dir \
                 --index-url "https://download.pytorch.org/whl/${CUDA_CHANNEL}" \
                 "torch==${TORCH_VERSION}" "fbgemm-gpu==${FBGEMM_VERSION}" ;; \
      *) echo "VARIANT must be cpu or cuda, got '${VARIANT}'" >&2; exit 2 ;; \
    esac \
    && grep -v -E '^torch==' /tmp/lock.txt > /tmp/rest.txt \
    && /opt/gemflow/bin/pip install --no-cache-dir --no-deps -r /tmp/rest.txt -r docker/cluster-extras.txt
# Sources last, so editing code does not reinstall the stack. .dockerignore whitelists what enters the context.
COPY . .
# gemflow's C++ kernels (models/inference/native/), built here where a compiler is: the runtime has none. They
# pick AVX2 or their portable path at run time, so the image runs on any x86-64 node.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
    && rm -rf /var/lib/apt/lists/*
RUN /opt/gemflow/bin/pip install --no-cache-dir --no-deps --no-build-isolation . \
    && GEMFLOW_KERNELS_DIR=/opt/gemflow/kernels /opt/gemflow/bin/python -m models.inference.native \
    && mkdir -p configs \
    && find /opt/gemflow -name '__pycache__' -type d -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="gemflow" \
      org.opencontainers.image.description="gemflow CLI and stages (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
# Java for the data plane's Spark engine (data_engine: spark runs PySpark in the stage pod).
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless=17.0.21.1+2-1~deb12u1 \
    && rm -rf /var/lib/apt/lists/*
# A fixed numeric uid/gid so runAsNonRoot can be verified by the kubelet.
RUN groupadd --gid 10001 gemflow \
    && useradd --uid 10001 --gid gemflow --no-create-home --home-dir /home/gemflow --shell /usr/sbin/nologin gemflow \
    && install -d -o gemflow -g gemflow /home/gemflow /data/gemflow
COPY --from=builder /opt/gemflow /opt/gemflow
COPY --from=builder /src/configs /opt/gemflow/configs
# The Spark stages (stages.dataEngine: spark): spark-submit's Python entry (the gemflow CLI as a .py file) and
# the entrypoint Spark's driver and executor pods need (the Spark pod template sets it as their command).
RUN printf 'from gemflow.cli import app\n\napp()\n' > /opt/gemflow/spark_main.py
COPY --chmod=0755 docker/spark-entrypoint.sh /opt/gemflow/spark-entrypoint.sh
ENV PATH=/opt/gemflow/bin:${PATH} \
    GEMFLOW_HOME=/data/gemflow \
    HOME=/home/gemflow \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    TORCH_EXTENSIONS_DIR=/tmp/torch_extensions \
    GEMFLOW_KERNELS_DIR=/opt/gemflow/kernels \
    MLFLOW_DISABLE_TELEMETRY=true \
    DO_NOT_TRACK=true \
    GX_ANALYTICS_ENABLED=false
WORKDIR /data/gemflow
USER 10001:10001
ENTRYPOINT ["gemflow"]
CMD ["--help"]
