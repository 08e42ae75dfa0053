#!/usr/bin/env bash
# Biased matrix factorisation on MovieLens 100K from scratch, on the CPU, ending with the test
# RMSE: the examples/movielens split, a user id, a movie id and the rating, nothing else.
#
#   examples/mf/run.sh OUT_DIR                   # two ranks, the tables sharded row-wise
#   NPROC=1 examples/mf/run.sh OUT_DIR           # one process
#   examples/mf/run.sh OUT_DIR train.epochs=1    # more arguments: training overrides
#
# Steps: set-up (a .venv, once), download + prepare the data (OUT_DIR/ratings.parquet, as
# examples/movielens/run.sh does), preprocess it with examples/mf/spec.yaml (OUT_DIR/mf_bin:
# no dense column), train with the `mf_movielens` preset (conf/experiment/mf_movielens.yaml:
# L2 on the tables through sparse weight decay, settings chosen on the val split only), which
# scores the test split once after training. Results: OUT_DIR/run_np$NPROC/metrics.jsonl,
# whose last row is the test split.
# Env: NPROC (ranks, default 2), VENV (a Python environment with hybridrec's dependencies,
# default .venv in the repository, made by scripts/setup.sh when missing).
set -euo pipefail

OUT=${1:?usage: examples/mf/run.sh OUT_DIR [hybridrec-train overrides ...]}
shift
NPROC=${NPROC:-2}
source "$(dirname "$0")/../env.sh"  # ROOT (the working directory), OUT absolute, PY

# 1. Data: MovieLens 100K with the fixed train/val/test split of examples/movielens.
"$PY" examples/movielens/prepare.py "$OUT"

# 2. Preprocess: user and movie ids as themselves, the rating as the label, no dense column
#    (--overwrite: step 1 has just rewritten the input).
"$PY" -m hybridrec.data.preprocess_cli --spec examples/mf/spec.yaml \
  --input "$OUT/ratings.parquet" --output "$OUT/mf_bin" --overwrite

# 3. Train and test: the preset's settings on NPROC local ranks, a fresh run directory.
RUN=$OUT/run_np$NPROC
rm -rf "$RUN"
"$PY" -m hybridrec.main experiment=mf_movielens data.path="$OUT/mf_bin" \
  launcher.nproc_per_node="$NPROC" hydra.run.dir="$RUN" "$@"

# 4. The val and test RMSE: the last rows of metrics.jsonl.
"$PY" examples/movielens/report.py "$RUN/metrics.jsonl"
