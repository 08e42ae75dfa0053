#!/usr/bin/env bash
# The GPU checks and benchmarks. On this machine first:  bash scripts/gpu_wheels.sh
# (it saves the wheels the GPU machine lacks into .whl/: carry it with the call), then there:
#
#   bash benchmarks/gpu_suite.sh all        every check below in order, within 9 minutes on
#                                           one H100 or H200 (one device-tool call)
#   bash benchmarks/gpu_suite.sh SECTION [ARGS]   one section; ARGS go to its command:
#     env          versions, GPU, memory, commit (COMMIT=... names it where there is no .git)
#     tests        pytest -n 8 --timeout 150 on the GPU tests and the CUDA-parametrised ones
#                  (ARGS: test paths instead, e.g. tests/gpu/test_gpu_host.py)
#     probe        the library model on CUDA vs the CPU: max relative loss difference per
#                  optimizer (tests/gpu/library_model.py)
#     step         benchmarks.step, Kaggle DLRM, B = 65,536
#     host-kaggle  benchmarks.host_cache, Kaggle DLRM, every table on the host, 5% caches
#     host-1tb     benchmarks.host_cache, 1TB cardinalities on the host, 12 GB of caches
#     and, outside `all`: lookup, host-copy, kernels, kernels-host, profile
#   (later flags win, e.g. `step --steps 10`)
#
# Output: $OUT when set, else /tmp/hybridrec_gpu/<date-time>. `all` leaves 8 files there:
# suite.log (the environment, then each section's exit code and seconds), tests.log,
# probe.log, step.log, host.log (both host runs) and the reports step_<card>.md,
# host_cache_kaggle_<card>.md, host_cache_1tb_<card>.md (<card>: h100, h200, ... from
# nvidia-smi; CARD=... overrides); one section alone writes <section>.log and its report.
# Copy the reports to benchmarks/results/ and commit them with the numbers in the notes.
# Each section runs under its own timeout; in `all` also within SUITE_S seconds in total
# (default 520: with the last section's 10 s kill grace, within 9 minutes). A section gets
# at most its own limit and never the time the sections after it need at least, so a hung
# section cannot starve the rest.
# DRY_RUN=1 prints each section's commands and limits instead of running them.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DRY_RUN=${DRY_RUN:-0}
export OUT=${OUT:-/tmp/hybridrec_gpu/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
suite_start=$SECONDS

# Wheels from scripts/gpu_wheels.sh for the modules this machine lacks (pure Python).
if [ -d .whl ] && [ "$DRY_RUN" != 1 ]; then
  wheels=()
  python3 -c "import hydra, omegaconf" 2>/dev/null ||
    wheels+=(.whl/hydra_core-*.whl .whl/omegaconf-*.whl .whl/antlr4_python3_runtime-*.whl)
  python3 -c "import xdist" 2>/dev/null || wheels+=(.whl/pytest_xdist-*.whl .whl/execnet-*.whl)
  python3 -c "import pytest_timeout" 2>/dev/null || wheels+=(.whl/pytest_timeout-*.whl)
  present=()
  for w in ${wheels[@]+"${wheels[@]}"}; do [ -f "$w" ] && present+=("$w"); done
  if [ ${#present[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "${present[@]}" || echo "gpu_suite: installing ${present[*]} failed"
  fi
fi
[ -d /tmp/site ] && export PYTHONPATH=$PWD:/tmp/site

card=${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
  sed -E 's/^NVIDIA //; s/^(GeForce|Tesla|Quadro) //; s/^RTX //' | awk '{print $1}' |
  cut -d- -f1 | tr 'A-Z' 'a-z' | tr -cd 'a-z0-9')}
export CARD=${card:-gpu}

# The GPU tests: tests/gpu and the tests parametrised over CUDA elsewhere.
export GPU_TESTS="tests/gpu tests/unit/test_triton_training.py tests/unit/test_host_cache.py
  tests/unit/test_no_sync_ops.py tests/distributed/test_handoff.py tests/train/test_profile.py"

x() {  # print a command, then run it (only print it under DRY_RUN=1)
  echo "+ $*"
  [ "$DRY_RUN" = 1 ] || "$@"
}

sec_env() {
  x nvidia-smi
  x nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  x python3 -c "import sys, importlib.metadata as m
print('python', sys.version.split()[0])
for p in ('torch', 'triton', 'numpy', 'pyarrow', 'hydra-core', 'pytest', 'pytest-xdist',
          'pytest-timeout'):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, 'missing')
import torch
print('cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  x nproc
  x free -g
  # COMMIT=...: where the copy on this machine has no .git
  echo "commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (no .git)')}"
}

sec_tests() {
  local flags=(-q -p no:cacheprovider --durations=15)
  if python3 -c "import xdist" 2>/dev/null; then
    flags+=(-n 8)
  else
    echo "gpu_suite: pytest-xdist missing (run scripts/gpu_wheels.sh, carry .whl): one process"
  fi
  if python3 -c "import pytest_timeout" 2>/dev/null; then
    flags+=(--timeout 150)
  else
    echo "gpu_suite: pytest-timeout missing: only the section's timeout bounds a test"
  fi
  # shellcheck disable=SC2086  # GPU_TESTS: paths split on whitespace
  if [ $# -eq 0 ]; then set -- $GPU_TESTS; fi
  x python3 -m pytest "$@" "${flags[@]}"
}

sec_probe() {
  x python3 -m tests.gpu.library_model --device cuda "$@"
}

sec_step() {
  # `all`: the rows of the issue-30 table; alone: every variant as well
  local more=(--plain-adam --kernels triton,torch --per-table-layout --fp32-handoff --graphs)
  [ "${IN_ALL:-0}" = 1 ] && more=(--kernels triton)
  x python3 -m benchmarks.step --device cuda --model dlrm_kaggle --batch-size 65536 \
    "${more[@]}" --out "$OUT/step_$CARD.md" "$@"
}

sec_host_kaggle() {
  # host_copy=auto times the UVA kernel and staged copies at start and logs both; 300 warmup
  # steps: past the warm start, as benchmarks/results/cache_policy_halflife_*; `all`: SGD only,
  # no naive CPU tables (tens of seconds to build)
  local more=()
  [ "${IN_ALL:-0}" = 1 ] && more=(--optimizers sgd --naive-steps 0)
  x python3 -m benchmarks.host_cache --device cuda --model dlrm_kaggle --batch-size 65536 \
    --cache-fraction 0.05 --warmup 300 "${more[@]}" --out "$OUT/host_cache_kaggle_$CARD.md" "$@"
}

sec_host_1tb() {
  x free -g
  # 400 warmup steps (about 6 s): dirty rows are written back from about then on (the CPU
  # replay, cache_policy_halflife_1tb.md). 60 timed steps per way: an eviction that writes
  # back ~300K rows comes every ~12 steps (see docs/host-cache.md, Measuring)
  local more=()
  [ "${IN_ALL:-0}" = 1 ] && more=(--optimizers sgd)
  x python3 -m benchmarks.host_cache --device cuda --model dlrm_1tb --batch-size 65536 \
    --cache-gb 12 --hbm-gb 16 --warmup 400 --steps 60 --no-device-baseline --naive-steps 0 \
    "${more[@]}" --out "$OUT/host_cache_1tb_$CARD.md" "$@"
}

sec_lookup() {
  x python3 -m benchmarks.lookup_update --device cuda --optimizer all \
    --out "$OUT/lookup_update_$CARD.md" "$@"
}

sec_host_copy() {
  # whole steps with each copy path forced
  x python3 -m benchmarks.host_cache --device cuda --model dlrm_kaggle --batch-size 65536 \
    --cache-fraction 0.05 --warmup 100 --optimizers sgd --host-copy kernel,staged \
    --no-device-baseline --naive-steps 0 --out "$OUT/host_copy_kaggle_$CARD.md" "$@"
}

sec_kernels() {
  # where a Kaggle step's device time goes, op by op and kernel by kernel
  x python3 -m benchmarks.profile_step --device cuda --optimizers sgd,rowwise_adagrad \
    --kernels triton --out "$OUT/profile_step_$CARD.md" "$@"
}

sec_kernels_host() {
  # the same for sharding=host with a 5% cache
  x python3 -m benchmarks.profile_step --device cuda --optimizers sgd --batches 8 \
    --override sharding=host --override sharding.cache_fraction=0.05 \
    --out "$OUT/profile_host_$CARD.md" "$@"
}

sec_profile() {
  # a trace of 5 training steps (Kaggle model, Triton kernels, compiled dense part) and the
  # host syncs inside them (expected: none); trace in $OUT/profile/
  x python3 -m hybridrec.main model=dlrm_kaggle device=cuda train.batch_size=65536 \
    train.steps=40 train.log_every=40 train.profile_start=30 train.profile_steps=5 \
    eval.every=0 eval.batches=1 eval.batch_size=65536 train.progress=plain \
    hydra.run.dir="$OUT/profile_run" "$@"
  [ "$DRY_RUN" = 1 ] || mv "$OUT/profile_run/profile" "$OUT/profile" 2>/dev/null
}

export -f x sec_env sec_tests sec_probe sec_step sec_host_kaggle sec_host_1tb sec_lookup \
  sec_host_copy sec_kernels sec_kernels_host sec_profile

# run NAME LIMIT_S LOG [ARGS]: the section under `timeout` (its whole process group), its
# output shown and appended to LOG; returns its exit code (124: timed out)
run() {
  local name=$1 limit=$2 log=$3
  shift 3
  {
    echo "== $name: limit ${limit}s, $(date -u '+%F %T UTC')"
    timeout -k 10 "$limit" bash -c 'sec_'"${name//-/_}"' "$@"' _ "$@" </dev/null
  } 2>&1 | tee -a "$log"
  return "${PIPESTATUS[0]}"
}

SECTIONS="env tests probe step host-kaggle host-1tb lookup host-copy kernels kernels-host profile"
section=${1:?"section: all | ${SECTIONS// / | }"}
shift
if [ "$section" != all ]; then
  case " $SECTIONS " in
    *" $section "*) ;;
    *) echo "gpu_suite: unknown section '$section': all | ${SECTIONS// / | }"; exit 2 ;;
  esac
  if [ "$section" != env ]; then  # what ran it, at the top of its log
    { x nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      x python3 -c "import torch, triton; print('torch', torch.__version__, 'triton',
triton.__version__)"
    } 2>&1 | tee -a "$OUT/$section.log"
  fi
  run "$section" "${SECTION_S:-590}" "$OUT/$section.log" "$@"
  exit $?
fi

# all: name, its own limit, the least it needs (s), its log
export IN_ALL=1
PLAN="env 20 5 suite.log
tests 200 100 tests.log
probe 90 30 probe.log
step 100 60 step.log
host-kaggle 100 60 host.log
host-1tb 200 90 host.log"
budget=${SUITE_S:-520}
status=0
summary=()
while read -r name own least log; do
  later=$(echo "$PLAN" | awk -v n="$name" 'f {s += $3} $1 == n {f = 1} END {print s + 0}')
  left=$((budget - (SECONDS - suite_start) - later))
  limit=$((own < left ? own : left))
  if [ "$limit" -lt "$least" ]; then
    summary+=("$name: skipped, ${left}s left for it (needs ${least}s)")
    status=1
    continue
  fi
  start=$SECONDS
  run "$name" "$limit" "$OUT/$log"
  rc=$?
  [ "$rc" = 0 ] || status=1
  note=""
  [ "$rc" = 124 ] && note=" (timed out)"
  summary+=("$name: exit $rc$note, $((SECONDS - start))s of ${limit}s -> $log")
done <<<"$PLAN"
{
  echo "== suite: card $CARD, $((SECONDS - suite_start))s in all, output $OUT"
  printf '%s\n' "${summary[@]}"
  ls -la "$OUT"
} | tee -a "$OUT/suite.log"
exit $status
