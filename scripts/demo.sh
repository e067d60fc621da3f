#!/usr/bin/env bash
# make demo: the platform on embedded defaults, the pipeline run by Airflow's scheduler, one live ranking request.
#   gemflow up  ->  gemflow_land lands the last DEMO_DAYS days of synthetic logs (catch-up)  ->  gemflow_ingest
#   per day  ->  gemflow_train (once: the trigger rule skips the backfill's earlier days)  ->  gemflow_register
#   (gate -> @champion)  ->  gemflow_refresh (embeddings into Feast)  ->  gemflow_ranker (embedding backfill,
#   point-in-time training set, ranker, gate)  ->  gemflow_deploy (KServe server, smoke test, promote).
# Each DAG is triggered by the asset event of the one before; nothing is run by hand. The platform stays up for a
# look at the UIs; `make down` stops it (DEMO_DOWN=1 stops it at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
export GEMFLOW_HOME=${GEMFLOW_HOME:-$REPO/workspace/demo}
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true GX_ANALYTICS_ENABLED=false
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}
G=$REPO/.venv/bin/gemflow
DAYS=${DEMO_DAYS:-4}  # train = days 1-2 (day 2 joins day 1's ad_stats counters), valid, test
PORT=${DEMO_PORT:-8080}
CONFIG=${DEMO_CONFIG:-configs/embedded-platform.yaml}
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "0. Fresh workspace $GEMFLOW_HOME"
[ -f "$GEMFLOW_HOME/platform/state.json" ] && $G down -w "$GEMFLOW_HOME" || true
rm -rf "$GEMFLOW_HOME"

step "1. gemflow up: Airflow 3 (API server + UI, scheduler, DAG processor, triggerer) and the MLflow UI"
$G up -w "$GEMFLOW_HOME" -c "$CONFIG" --set backfill_days="$DAYS" --set endpoint_port="$PORT" \
  --set data_engine="${DEMO_ENGINE:-local}" ${DEMO_UP_ARGS:-}
[ "${DEMO_DOWN:-0}" = 1 ] && trap '$G down -w "$GEMFLOW_HOME" >/dev/null 2>&1 || true' EXIT

step "2. The scheduler runs the chain by itself: land -> ingest -> train -> register -> refresh -> ranker -> deploy"
$G wait -w "$GEMFLOW_HOME" --dag gemflow_deploy --timeout "${DEMO_TIMEOUT:-5400}"

step "3. A live ranking request to the KServe endpoint the deploy DAG started"
LAST=$(ls "$GEMFLOW_HOME/offline/events" | sort | tail -n 1 | cut -d= -f2)
USER_ID=$($REPO/.venv/bin/python -c "
import pandas as pd, sys; e = pd.read_parquet(sys.argv[1]); print(int(e.user_id.value_counts().index[0]))" \
  "$GEMFLOW_HOME/offline/events/date=$LAST")
CANDS=$($REPO/.venv/bin/python -c "
import pandas as pd, sys; a = pd.read_parquet(sys.argv[1]); print(','.join(map(str, a.ad_id.head(1000))))" \
  "$GEMFLOW_HOME/raw/ads/date=$LAST")
$G rank --url "http://127.0.0.1:$PORT" --user "$USER_ID" --candidates "$CANDS" --top 10

if [ "${DEMO_DOWN:-0}" = 1 ]; then
  step "Done. DEMO_DOWN=1: the platform stops now (gemflow down)"
else
  step "Done. The platform is still up (workspace $GEMFLOW_HOME): the addresses are printed above; stop it with"
  echo "  $G down -w $GEMFLOW_HOME     (or: make down GEMFLOW_HOME=$GEMFLOW_HOME)"
fi
