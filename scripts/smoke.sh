#!/usr/bin/env bash
# Set up the project virtualenv (.venv) and run the main job on its embedded default (CPU smoke),
# tracking to MLflow in a local sqlite file, mlflow.db in the project folder. Idempotent.
#
#   bash scripts/smoke.sh
#
# Browse the results afterwards with:
#   .venv/bin/papo-nb ui
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"

bash scripts/test.sh --setup-only

export MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-sqlite:///$ROOT/mlflow.db}"
echo "==> MLFLOW_TRACKING_URI=$MLFLOW_TRACKING_URI"

PAPO_NB="$ROOT/.venv/bin/papo-nb"
"$PAPO_NB" env

start=$SECONDS
rc=0
"$PAPO_NB" run --params params/smoke.yaml || rc=$?
echo "==> smoke wall time: $((SECONDS - start)) s"
exit "$rc"
