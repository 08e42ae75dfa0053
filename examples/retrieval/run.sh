#!/usr/bin/env bash
# Top-K retrieval on MovieLens 100K from scratch, on the CPU, ending with val and test HR@10,
# NDCG@10 and HR@50 over the whole catalogue.
#
#   examples/retrieval/run.sh OUT_DIR                  # two ranks, the tables sharded row-wise
#   NPROC=1 examples/retrieval/run.sh OUT_DIR          # one process
#   examples/retrieval/run.sh OUT_DIR train.epochs=5   # more arguments: training overrides
#   MIN_RATING=4 examples/retrieval/run.sh OUT_DIR     # another split: 4 and 5 stars only
#
# Steps: set-up (a .venv, once), download + prepare the data with the leave-last-out split
# (OUT_DIR/interactions.parquet; examples/retrieval/README.md has the protocol), preprocess it
# with the dataset spec (OUT_DIR/bin), train with the `retrieval_movielens` preset
# (conf/experiment/retrieval_movielens.yaml, its settings chosen on the val split only), which
# ranks the catalogue (every movie of the items file: OUT_DIR/catalogue.txt) for val and then
# test after training. Results: OUT_DIR/run_np$NPROC/metrics.jsonl, whose last row is the
# test split.
# Env: NPROC (ranks, default 2), MIN_RATING (keep only ratings of this many stars or more:
# prepare.py --min-rating; default every rating), VENV (a Python environment with
# hybridrec's dependencies, default .venv in the repository, made by scripts/setup.sh when
# missing).
set -euo pipefail

OUT=${1:?usage: examples/retrieval/run.sh OUT_DIR [hybridrec-train overrides ...]}
shift
NPROC=${NPROC:-2}
source "$(dirname "$0")/../env.sh"  # ROOT (the working directory), OUT absolute, PY

# 1. Data: every rating a positive (user, movie) pair; per user the last is test, the one
#    before it val (sorted by timestamp, then movie id).
"$PY" examples/retrieval/prepare.py "$OUT" ${MIN_RATING:+--min-rating "$MIN_RATING"}

# 2. Preprocess: user and movie ids as themselves, each rating's history of earlier movies, no
#    dense column (--overwrite: step 1 has just rewritten the input).
"$PY" -m hybridrec.data.preprocess_cli --spec examples/retrieval/spec.yaml \
  --input "$OUT/interactions.parquet" --output "$OUT/bin" --overwrite

# 3. Train and rank: the preset's settings on NPROC local ranks, a fresh run directory; the
#    catalogue is every movie of the items file (some may have no rating in train: never
#    ranked, the log says how many).
RUN=$OUT/run_np$NPROC
rm -rf "$RUN"
"$PY" -m hybridrec.main experiment=retrieval_movielens data.path="$OUT/bin" \
  train.retrieval.catalogue="$OUT/catalogue.txt" launcher.nproc_per_node="$NPROC" \
  hydra.run.dir="$RUN" "$@"

# 4. Val and test HR@10, NDCG@10, HR@50: the last rows of metrics.jsonl.
"$PY" examples/retrieval/report.py "$RUN/metrics.jsonl"
