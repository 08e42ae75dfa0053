#!/usr/bin/env bash
# The GPU checks and benchmarks, one section per device-tool call (each fits its 10 minutes).
# On this machine first:  bash scripts/gpu_wheels.sh    (carry .whl with the call), then
#   device run:  bash benchmarks/gpu_suite.sh tests|step|lookup|host-kaggle|host-1tb|host-copy|
#                kernels|kernels-host|profile
#   (tests takes optional test paths: bash benchmarks/gpu_suite.sh tests tests/gpu/test_gpu_host.py)
# Results land in $OUT (the device tool brings them back) as <section>.log and reports .md;
# copy the reports to benchmarks/results/ and commit them with the numbers in the notes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hybridrec_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -d .whl ] && ! python3 -c "import hydra" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
fi
section=${1:?section: tests | step | lookup | host-kaggle | host-1tb | host-copy | kernels | kernels-host | profile}
shift
# anything after the section name: test paths for `tests`, extra flags for the benchmarks
# (later flags win, e.g. `step --steps 10`)
log="$OUT/$section.log"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  case "$section" in
    tests)
      # all of tests/gpu, or the files given after the section name (to split the suite over
      # two calls if one does not fit its 10 minutes); per-test durations at the end
      python3 -m pytest "${@:-tests/gpu}" -q -p no:cacheprovider --durations=15
      ;;
    step)
      python3 -m benchmarks.step --device cuda --model dlrm_kaggle --batch-size 65536 \
        --plain-adam --kernels triton,torch --per-table-layout --fp32-handoff --graphs --out "$OUT/step_h100.md" "$@"
      ;;
    lookup)
      python3 -m benchmarks.lookup_update --device cuda --optimizer all --out "$OUT/lookup_update_h100.md" "$@"
      ;;
    host-kaggle)
      # host_copy=auto times the UVA kernel and staged copies at start and logs both;
      # add --inline-prefetch for rows whose prefetch admits on the main thread (to compare)
      # 300 warmup steps: past the warm start, as benchmarks/results/cache_policy_halflife_*
      python3 -m benchmarks.host_cache --device cuda --model dlrm_kaggle --batch-size 65536 \
        --cache-fraction 0.05 --warmup 300 --out "$OUT/host_cache_kaggle_h100.md" "$@"
      ;;
    host-copy)
      # optional: whole steps with each copy path forced
      python3 -m benchmarks.host_cache --device cuda --model dlrm_kaggle --batch-size 65536 \
        --cache-fraction 0.05 --warmup 100 --optimizers sgd --host-copy kernel,staged \
        --no-device-baseline --naive-steps 0 --out "$OUT/host_copy_kaggle_h100.md" "$@"
      ;;
    host-1tb)
      free -g
      # 400 warmup steps (about 6 s): dirty rows are written back from about then on (the
      # CPU replay, cache_policy_halflife_1tb.md); the first H100 run's 30 were not enough
      python3 -m benchmarks.host_cache --device cuda --model dlrm_1tb --batch-size 65536 \
        --cache-gb 12 --hbm-gb 16 --warmup 400 --no-device-baseline --naive-steps 0 \
        --out "$OUT/host_cache_1tb_h100.md" "$@"
      ;;
    kernels)
      # where a Kaggle step's device time goes, op by op and kernel by kernel
      python3 -m benchmarks.profile_step --device cuda --optimizers sgd,rowwise_adagrad \
        --kernels triton --out "$OUT/profile_step_h100.md" "$@"
      ;;
    kernels-host)
      # the same for sharding=host with a 5% cache (issue 8's same-size comparison)
      python3 -m benchmarks.profile_step --device cuda --optimizers sgd --batches 8 \
        --override sharding=host --override sharding.cache_fraction=0.05 \
        --out "$OUT/profile_host_h100.md" "$@"
      ;;
    profile)
      # optional: a trace of 5 training steps (Kaggle model, Triton kernels, compiled dense
      # part) and the host syncs inside them (expected: none); trace in $OUT/profile/
      python3 -m hybridrec.main model=dlrm_kaggle device=cuda train.batch_size=65536 \
        train.steps=40 train.log_every=40 train.profile_start=30 train.profile_steps=5 \
        eval.every=0 eval.batches=1 eval.batch_size=65536 train.progress=plain \
        hydra.run.dir="$OUT/profile_run" "$@"
      mv "$OUT/profile_run/profile" "$OUT/profile" 2>/dev/null
      ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
} 2>&1 | tee "$log"
