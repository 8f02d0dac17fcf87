#!/usr/bin/env bash
# The GPU paths in one command (see bench/gpu_check.py). Run from the repository root after the
# README's install; a CUDA build of torch is needed (the README's pinned torch is the CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec timeout 300 "$PY" bench/gpu_check.py "$@"
