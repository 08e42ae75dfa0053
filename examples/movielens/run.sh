#!/usr/bin/env bash
# MovieLens 100K rating prediction from scratch, on the CPU, ending with the test RMSE.
#
#   examples/movielens/run.sh OUT_DIR              # one process
#   NPROC=2 examples/movielens/run.sh OUT_DIR      # two ranks, the tables sharded row-wise
#   examples/movielens/run.sh OUT_DIR train.epochs=1   # more arguments: training overrides
#
# Steps: set-up (a .venv, once), download + prepare the data (OUT_DIR/ratings.parquet),
# preprocess it with the dataset spec (OUT_DIR/bin), train with the `movielens` experiment
# preset (conf/experiment/movielens.yaml, its settings chosen on the val split only), which
# scores the test split once after training. Results: OUT_DIR/run_np$NPROC/metrics.jsonl,
# whose last row is the test split. 1 and N ranks compute the same thing (their numbers
# differ only by float round-off, which grows over the steps: benchmarks/results/movielens.md).
# Env: NPROC (ranks, default 1), VENV (a Python environment with hybridrec's dependencies,
# default .venv in the repository, made by scripts/setup.sh when missing).
set -euo pipefail

OUT=${1:?usage: examples/movielens/run.sh OUT_DIR [hybridrec-train overrides ...]}
shift
NPROC=${NPROC:-1}

# 1. Set-up: examples/env.sh (scripts/setup.sh makes .venv when it is missing).
source "$(dirname "$0")/../env.sh"  # ROOT (the working directory), OUT absolute, PY

# 2. Data: MovieLens 100K with a fixed train/val/test split and each rating's user and movie
#    history (from the non-test ratings only; see prepare.py's docstring).
"$PY" examples/movielens/prepare.py "$OUT"

# 3. Preprocess: ids, standardized dense columns and list features per the spec
#    (--overwrite: step 2 has just rewritten the input, so an earlier OUT_DIR/bin is redone).
"$PY" -m hybridrec.data.preprocess_cli --spec examples/movielens/spec.yaml \
  --input "$OUT/ratings.parquet" --output "$OUT/bin" --overwrite

# 4. Train and test: the preset's settings, NPROC local ranks (gloo on the CPU), a fresh run
#    directory (metrics.jsonl is appended to, so an old one would be kept).
RUN=$OUT/run_np$NPROC
rm -rf "$RUN"
"$PY" -m hybridrec.main experiment=movielens data.path="$OUT/bin" \
  launcher.nproc_per_node="$NPROC" hydra.run.dir="$RUN" "$@"

# 5. The test RMSE: the last row of metrics.jsonl (eval.final_split=test in the preset).
"$PY" examples/movielens/report.py "$RUN/metrics.jsonl"
