#!/usr/bin/env bash
# bash benchmarks/gpu_check.sh [OUT_DIR]   (default outputs/gpu_check)
#
# The GPU machine's check in one command (<= 8 min on one H200, no network): installs the wheels
# of .gpu_wheels/ (made first by benchmarks/gpu_wheels.sh on a machine with network), then runs
# the GPU tests and benchmarks, each with its own timeout, into OUT_DIR/gpu_check.json (+ .log).
# The steps live in benchmarks/gpu_check.py; extra arguments go to it (e.g. --smoke on a CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_check}
shift || true
# the image's python3 (the one with CUDA torch); here, a venv's python if it is first on PATH
exec "${PYTHON:-python3}" benchmarks/gpu_check.py --out "$OUT" "$@"
