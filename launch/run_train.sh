#!/usr/bin/env bash
# Single-node launch: NGPU ranks on this machine with torchrun; arguments are Hydra overrides.
#
#   NGPU=8 launch/run_train.sh model=dlrm_kaggle sharding=auto train.batch_size=65536
#   NGPU=2 DEVICE=cpu launch/run_train.sh sharding=row_wise      # gloo ranks on CPU
# train.batch_size and eval.batch_size (defaults 1024, 2048) must divide by NGPU: with
# NGPU=3 pass e.g. train.batch_size=1023 eval.batch_size=2046
#
# Knobs (environment): NGPU (ranks, default: visible GPUs, else 2), DEVICE (auto|cpu|cuda),
# MAX_RESTARTS (torchrun restarts after a failure, default 0), HYBRIDREC_RUN_ID (run dir name,
# default: a timestamp, shared by all ranks), PYTHON (interpreter, default .venv/bin/python
# when scripts/setup.sh made one, which holds torch and hybridrec, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 2)")
fi
export HYBRIDREC_RUN_ID=${HYBRIDREC_RUN_ID:-$(date +%Y-%m-%d/%H-%M-%S)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
  --max-restarts="${MAX_RESTARTS:-0}" -m hybridrec.main device="${DEVICE:-auto}" "$@"
