#!/usr/bin/env bash
# make demo: the whole pipeline on embedded defaults (SQLite, local files, local processes), driven by Airflow.
#   raw logs -> gemflow_ingest (per day) -> gemflow_train (user model) -> gemflow_register (gate -> @champion)
#   -> gemflow_refresh (embeddings into Feast) -> ranker (train + gate) -> gemflow_deploy (KServe server + smoke
#   test) -> one live ranking request.
# Each `airflow dags test` runs a DAG the way the scheduler would (its tasks call the project CLI); the Assets
# that chain the DAGs on a running scheduler are named in each step.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
export GEMFLOW_HOME=${GEMFLOW_HOME:-$REPO/workspace/demo}
export GEMFLOW_BIN=$REPO/.venv/bin/gemflow GEMFLOW_MODE=local
export AIRFLOW_HOME=$GEMFLOW_HOME/airflow
export AIRFLOW__CORE__DAGS_FOLDER=$REPO/dags AIRFLOW__CORE__LOAD_EXAMPLES=False
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true GX_ANALYTICS_ENABLED=false
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}
G=$GEMFLOW_BIN
AIRFLOW=$REPO/.venv-airflow/bin/airflow
START=2026-01-01
DAYS=${DEMO_DAYS:-3}
PORT=${DEMO_PORT:-8080}
LAST=$(date -u -d "$START + $((DAYS - 1)) day" +%F)
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
dag() {  # dag ID [DATE] [CONF]: run one DAG like the scheduler would, print its final state
  local out
  out=$($AIRFLOW dags test "$1" ${2:+"$2"} ${3:+--conf "$3"} 2>&1) || { echo "$out" | tail -n 40; return 1; }
  echo "$out" | grep -oE "DagRun Finished: dag_id=[^,]*|state=[a-z_]*, run_type" | paste -sd' ' | sed 's/, run_type//'
  echo "$out" | grep -q "state=success, run_type" || { echo "$out" | grep -E "ERROR|Error|Exception" | tail -n 20; return 1; }
}
trap '$G undeploy >/dev/null 2>&1 || true' EXIT

step "0. Fresh workspace $GEMFLOW_HOME"
rm -rf "$GEMFLOW_HOME" && mkdir -p "$AIRFLOW_HOME"
$AIRFLOW db migrate >/dev/null 2>&1

step "1. Landing $DAYS days of synthetic ad-event logs (planted long/short-term interests, many action types)"
$G generate -c configs/synthetic-small.yaml --days "$DAYS" --start-date $START | grep -E '"(events|users|ads)"' || true

step "2. gemflow_ingest per logical date: GX gate (quarantine) -> offline store -> Feast (publishes gemflow.features)"
for i in $(seq 0 $((DAYS - 1))); do dag gemflow_ingest "$(date -u -d "$START + $i day" +%F)"; done

step "3. gemflow_train: training set + offline user model, tracked in MLflow (publishes gemflow.user_model)"
dag gemflow_train "$LAST" "{\"nproc\": 1, \"config\": \"$REPO/configs/demo-user.yaml\"}"

step "4. gemflow_register: user model -> @challenger -> gate -> @champion (publishes gemflow.champion)"
# a two-minute demo model is not calibrated to production bounds: the demo widens them, the DAG's defaults do not
dag gemflow_register "$LAST" '{"kind": "user", "calibration_low": 0.5, "calibration_high": 2.0}'

step "5. gemflow_refresh: champion embeddings -> Feast user_embedding, tagged with its version (gemflow.embeddings)"
# On a schedule the refresh runs after every ingested day; the demo backfills the earlier days first, so each
# ranker example below joins the embedding that was live at its time (point in time), then runs the DAG.
for i in $(seq 0 $((DAYS - 2))); do
  $G refresh-embeddings --date "$(date -u -d "$START + $i day" +%F)" --nproc 1 | tail -n 1
done
dag gemflow_refresh "$LAST" '{"nproc": 1}'

step "6. Online ranker on point-in-time Feast features (cached user embeddings + fresh events), gated"
$G build-training-set --start $START --end "$LAST" --name ranker-demo >/dev/null
$G train --model ranker -t ranker-demo -c configs/demo-ranker.yaml -s tracking.run_name=ranker-demo | tail -n 3
$G register-run --kind ranker --run-dir "$GEMFLOW_HOME/models/ranker/ranker-demo" --calibration-low 0.5 --calibration-high 2.0

step "7. gemflow_deploy: KServe model server (local) -> smoke test -> promote"
dag gemflow_deploy "$LAST" "{\"port\": $PORT}"

step "8. A live ranking request to the running KServe server"
USER_ID=$($REPO/.venv/bin/python -c "
import pandas as pd, sys; e = pd.read_parquet(sys.argv[1]); print(int(e.user_id.value_counts().index[0]))" \
  "$GEMFLOW_HOME/offline/events/date=$LAST")
CANDS=$($REPO/.venv/bin/python -c "
import pandas as pd, sys; a = pd.read_parquet(sys.argv[1]); print(','.join(map(str, a.ad_id.head(1000))))" \
  "$GEMFLOW_HOME/raw/ads/date=$LAST")
$G rank --url "http://127.0.0.1:$PORT" --user "$USER_ID" --candidates "$CANDS" --top 10

step "Done. MLflow UI: $G mlflow-server -w $GEMFLOW_HOME   (workspace: $GEMFLOW_HOME)"
