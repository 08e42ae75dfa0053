#!/usr/bin/env bash
# Dynamic tables on a drifting stream, against the hashing trick at equal table memory and an
# unbounded vocabulary, on the CPU; then the dynamic run again on 2 ranks.
#
#   examples/dynamic/run.sh OUT_DIR             # writes OUT_DIR/result.json
#   examples/dynamic/run.sh OUT_DIR train.batch_size=1024   # more arguments: training overrides
#
# 1. make_stream.py: 8 days of clicks from a known teacher, users and items with random 40-bit
#    ids that are born and fade, their popularity drifting (OUT_DIR/stream/day=<d>/).
# 2. Three preprocessings of the same files: spec_dynamic.yaml (raw ids; 16384 user and 2048
#    item slots, LRU), spec_hashing.yaml (the same rows, ids hashed into them), and
#    spec_unbounded.yaml (a vocabulary over every train id: a row each).
# 3. Train each on days 0..6 in time order (one pass, no shuffling: a stream), test on day 7,
#    whose new users no model has seen; the dynamic run again on 2 ranks (sharded by bucket).
# 4. report.py: OUT_DIR/result.json (auc_dynamic, auc_hashing, auc_unbounded,
#    max_rel_loss_diff_1_vs_2_ranks, the mode, and the goals). Figures:
#    benchmarks/results/dynamic_stream.md.
# Env: VENV (a Python environment with hybridrec's dependencies; default .venv, made by
# scripts/setup.sh when missing). A few minutes on 2 CPU cores.
#   EXACT=1: every run in exact mode (train.exact=true, docs/exact.md): the 2-rank run gives
#     the 1-rank run's bits, so max_rel_loss_diff_1_vs_2_ranks is 0 over the whole stream.
#   STREAM_ARGS: more make_stream.py arguments (e.g. "--rows-per-day 2048" for a quick run;
#     the spec files split on 8 days, so keep --days at 8).
set -euo pipefail

OUT=${1:?usage: examples/dynamic/run.sh OUT_DIR [hybridrec-train overrides ...]}
shift
source "$(dirname "$0")/../env.sh"  # ROOT (the working directory), OUT absolute, PY
EXACT=${EXACT:-0}
case $EXACT in
  0 | 1) ;;
  *) echo "examples/dynamic/run.sh: EXACT=$EXACT; set EXACT=1 (exact mode) or 0" >&2; exit 2 ;;
esac

# shellcheck disable=SC2086  # STREAM_ARGS is a list of words
"$PY" examples/dynamic/make_stream.py "$OUT" ${STREAM_ARGS:-}

for KIND in dynamic hashing unbounded; do
  "$PY" -m hybridrec.data.preprocess_cli --spec "examples/dynamic/spec_$KIND.yaml" \
    --input "$OUT/stream" --output "$OUT/bin_$KIND" --overwrite
done

# One pass over the training days in time order; the test day scored once at the end. SGD for
# the MLPs: Adam's normalised steps amplify the float round-off by which 1 and 2 ranks differ
# (the dense gradients are summed in another order), for fixed tables as for dynamic ones.
TRAIN=(data=table data.shuffle=false train.epochs=1 train.batch_size=512 optim.sparse.lr=0.2
  optim.dense.name=sgd optim.dense.lr=0.1 data.eval_split=test eval.every=0 eval.batches=null
  train.log_every=2 train.progress=plain)
if [ "$EXACT" = 1 ]; then
  TRAIN+=(train.exact=true)  # train.exact_shards (8 by default) divides the batch of 512
fi
train() {  # train RUN_NAME KIND NPROC [overrides]
  local run=$OUT/run_$1 kind=$2 nproc=$3
  shift 3
  rm -rf "$run"
  echo "training $kind on $nproc rank(s) -> $run"
  "$PY" -m hybridrec.main "${TRAIN[@]}" data.path="$OUT/bin_$kind" \
    launcher.nproc_per_node="$nproc" hydra.run.dir="$run" "$@" > "$run.log" 2>&1 \
    || { tail -5 "$run.log"; exit 1; }
  grep -h "eval @" "$run.log" | tail -1
}
train dynamic dynamic 1 "$@"
train hashing hashing 1 "$@"
train unbounded unbounded 1 "$@"
train dynamic_np2 dynamic 2 "$@"

"$PY" examples/dynamic/report.py "$OUT"
