#!/usr/bin/env bash
# Set up (if needed) and train on the embedded default: synthetic Criteo-like data, dlrm_tiny.
# Extra arguments are Hydra overrides, e.g. scripts/train.sh train.steps=100 model=dlrm_kaggle
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/setup.sh | tail -n 1)
exec "$PY" -m hybridrec.main "$@"
