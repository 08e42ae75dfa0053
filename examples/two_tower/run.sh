#!/usr/bin/env bash
# A two-tower model of your own (examples/two_tower/model.py) on MovieLens 100K, trained by
# hybridrec-train through `model._target_`, tables sharded over NPROC ranks, ending with the
# test RMSE.
#
#   examples/two_tower/run.sh OUT_DIR              # one process
#   NPROC=2 examples/two_tower/run.sh OUT_DIR      # two ranks, the tables sharded row-wise
#   examples/two_tower/run.sh OUT_DIR +model.args.dim=16   # more arguments: training overrides
#
# Steps: set-up (a .venv, once), download + prepare the data (examples/movielens/prepare.py:
# the same split as examples/movielens), preprocess it with this example's spec (spec.yaml:
# user and movie ids, their features and histories, two shared tables), train and score the
# test split once after training (its settings chosen on the val split only:
# benchmarks/results/two_tower.md). Results: OUT_DIR/run_np$NPROC/metrics.jsonl, whose last
# row is the test split. Env: NPROC (ranks, default 1), VENV (default .venv in the repository).
set -euo pipefail

OUT=${1:?usage: examples/two_tower/run.sh OUT_DIR [hybridrec-train overrides ...]}
shift
NPROC=${NPROC:-1}
source "$(dirname "$0")/../env.sh"  # ROOT (the working directory), OUT absolute, PY

"$PY" examples/movielens/prepare.py "$OUT"
"$PY" -m hybridrec.data.preprocess_cli --spec examples/two_tower/spec.yaml \
  --input "$OUT/ratings.parquet" --output "$OUT/bin" --overwrite

SHARDING=row_wise
if [ "$NPROC" = 1 ]; then SHARDING=none; fi
RUN=$OUT/run_np$NPROC
rm -rf "$RUN"
"$PY" -m hybridrec.main data=table data.path="$OUT/bin" \
  model._target_=examples.two_tower.model.TwoTower \
  sharding="$SHARDING" launcher.nproc_per_node="$NPROC" device=cpu \
  train.epochs=6 train.batch_size=256 train.log_every=280 optim.dense.lr=2e-3 \
  optim.schedule.decay_start=840 optim.schedule.decay_steps=840 \
  eval.every=280 eval.batches=null eval.final_split=test \
  hydra.run.dir="$RUN" "$@"

"$PY" examples/movielens/report.py "$RUN/metrics.jsonl"
