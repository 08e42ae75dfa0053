# Sourced by every examples/*/run.sh after it has read OUT (its output directory):
# ROOT (the repository, made the working directory), OUT made absolute (and created), PY (the
# Python of VENV, default ROOT/.venv, which scripts/setup.sh makes when missing: torch for the
# CPU, hybridrec editable), PYTHONPATH=ROOT (this checkout's hybridrec and examples, also in
# the ranks a run launches) and one thread per process unless OMP_NUM_THREADS says otherwise.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
VENV=${VENV:-$ROOT/.venv}
if [ ! -x "$VENV/bin/python" ]; then
  bash scripts/setup.sh
fi
PY=$VENV/bin/python
export PYTHONPATH=$ROOT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
