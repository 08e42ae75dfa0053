#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has torch, triton, numpy, pyarrow, tqdm, pytest; no network),
# saved into .whl/ (git-ignored) so the device tool can carry them: pure-Python packages only.
# hydra-core, omegaconf and antlr4 (the config), pytest-xdist, execnet and pytest-timeout
# (`gpu_suite.sh tests` runs -n 8 --timeout 150). Then, on the GPU machine:
#   bash benchmarks/gpu_suite.sh all|<section>   (it installs those its Python lacks)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp -d .whl hydra-core==1.3.2 omegaconf==2.3.0 \
  pytest-xdist==3.8.0 execnet==2.1.2 pytest-timeout==2.4.0 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
# antlr4's runtime is published as source only: build its (pure-Python) wheel here
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -la .whl
