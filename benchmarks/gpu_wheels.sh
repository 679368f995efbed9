#!/usr/bin/env bash
# bash benchmarks/gpu_wheels.sh [DIR]   (DIR default .gpu_wheels, git-ignored)
#
# Run on a machine WITH network, before benchmarks/gpu_check.sh on one without: fills DIR with the
# wheels the GPU image (Python 3.12, x86-64, torch 2.11 + CUDA, transformers 5.17) lacks, for
# `pip install --no-index --find-links DIR`. No torch, no CUDA packages: every wheel is named, with
# --no-deps. DeepSpeed's sdist is built here into a pure-Python wheel (DS_BUILD_OPS=0: its ops
# JIT-build on the GPU machine with its nvcc). Keep DIR under ~40 MiB (the tree that travels to the
# GPU machine must stay under 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu_wheels}
PY=${PYTHON:-python}
mkdir -p "$DIR"
# pure Python: any platform. The tested pins (.ci/constraints.txt, ../shared/STACK.md) and the
# versions of our venv; the small ones the resolver may want where the image's copy is too old
# or too new (typing_extensions for pydantic, fsspec <= 2026.9.0 for datasets, regex and
# transformers 5.24.0 and peft 0.21.2, the tested pins, instead of the image's versions).
PURE=(hjson==3.1.0 pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5
      typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1 fsspec==2026.9.0
      transformers==5.24.0 peft==0.21.2)
# compiled for CPython 3.12 on manylinux x86-64 (multiprocess has a py312 wheel of its own)
BINARY=(pydantic-core==2.50.5 multiprocess==0.70.19 regex==2026.11.19)
"$PY" -m pip download -q --no-deps -d "$DIR" "${PURE[@]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR" "${BINARY[@]}"
if ! ls "$DIR"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
    # setup.py imports torch: build in this environment (its CPU torch), not an isolated one
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation \
        --no-binary deepspeed -w "$DIR" deepspeed==0.19.8
fi
ls -1 "$DIR"
du -sh "$DIR"
