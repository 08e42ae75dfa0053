#!/usr/bin/env bash
# One-time set-up, idempotent: a virtualenv in .venv with torch (the CPU wheel when no torch is
# installed yet: an unpinned torch would pull a 5 GB CUDA build) and hybridrec in editable mode.
# Set HYBRIDREC_VENV=0 to install into the current Python instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${HYBRIDREC_VENV:-1}" != "0" ]; then
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv --system-site-packages .venv
  fi
  PY=.venv/bin/python
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# the editable install tracks the code; in .venv it is redone only when pyproject.toml changes
STAMP=/dev/null
[ "$PY" = .venv/bin/python ] && STAMP=.venv/.hybridrec-install
WANT=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || ! "$PY" -c "import hybridrec" 2>/dev/null; then
  "$PY" -m pip install -q -e ".[dev]"
  # the CPU sparse kernels (C, built once per machine; without a compiler the torch path runs)
  "$PY" -m hybridrec.kernels.native
  echo "$WANT" > "$STAMP" 2>/dev/null || true
fi
echo "$PY"
