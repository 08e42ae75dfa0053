#!/usr/bin/env bash
# Set up (if needed), lint, and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/setup.sh | tail -n 1)
"$PY" -m ruff check .
"$PY" -m pytest -q "$@"
