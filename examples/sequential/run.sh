#!/usr/bin/env bash
# SASRec next-item prediction on users' item sequences, on the CPU, ending with the test split's
# full-catalogue and sampled HR@10 / NDCG@10 (SASRec's protocol: the held-out item among 100
# items the user never saw).
#
#   examples/sequential/run.sh OUT_DIR                   # two ranks, the item table row-wise
#   NPROC=1 examples/sequential/run.sh OUT_DIR           # one process
#   examples/sequential/run.sh OUT_DIR train.epochs=1    # more arguments: training overrides
#
# Steps: set-up (a .venv, once), train with the `sasrec_games` preset
# (conf/experiment/sasrec_games.yaml) on DATA, split leave-one-out (each user's last item is
# test, the one before val), which scores the test split once after training. Results:
# OUT_DIR/run_np$NPROC/metrics.jsonl, whose last row is the test split.
# Env: NPROC (ranks, default 2), DATA (a `user item` file, default
# ../shared/data/amazon_games.txt beside the repository), VENV (a Python environment with
# hybridrec's dependencies, default .venv in the repository, made by scripts/setup.sh).
set -euo pipefail

OUT=${1:?usage: examples/sequential/run.sh OUT_DIR [hybridrec-train overrides ...]}
shift
NPROC=${NPROC:-2}
source "$(dirname "$0")/../env.sh"  # ROOT (the working directory), OUT absolute, PY
DATA=${DATA:-$ROOT/../shared/data/amazon_games.txt}
if [ ! -f "$DATA" ]; then
  echo "examples/sequential/run.sh: no sequences file at $DATA; set DATA=<a user item file>" >&2
  exit 2
fi

# Train and test: the preset's settings on NPROC local ranks, a fresh run directory.
RUN=$OUT/run_np$NPROC
rm -rf "$RUN"
"$PY" -m hybridrec.main experiment=sasrec_games data.path="$DATA" \
  launcher.nproc_per_node="$NPROC" hydra.run.dir="$RUN" "$@"

# The last val and the test evaluation: the last rows of metrics.jsonl.
"$PY" examples/sequential/report.py "$RUN/metrics.jsonl"
