#!/usr/bin/env bash
# Set up (if needed), lint, and run the test suite. Extra arguments go to pytest.
# The data tests read the 200-row Criteo sample, which is not in the repository: named by
# $HYBRIDREC_CRITEO_SAMPLE, or else ../shared/data/criteo_sample.tsv beside the repository when
# it is there (as CI checks it out); without it those tests skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${HYBRIDREC_CRITEO_SAMPLE:-}" ]; then
  if [ -f ../shared/data/criteo_sample.tsv ]; then
    HYBRIDREC_CRITEO_SAMPLE="$(cd ../shared/data && pwd)/criteo_sample.tsv"
    export HYBRIDREC_CRITEO_SAMPLE
  else
    echo "scripts/test.sh: no ../shared/data/criteo_sample.tsv and no \$HYBRIDREC_CRITEO_SAMPLE:" \
      "the tests that need the Criteo sample skip" >&2
  fi
fi
PY=$(scripts/setup.sh | tail -n 1)
"$PY" -m ruff check .
"$PY" -m pytest -q "$@"
