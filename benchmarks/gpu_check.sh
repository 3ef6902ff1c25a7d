#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): mtpctl's pipeline on a CUDA GPU in a few minutes, one table
# at the end; without a GPU it checks the CPU's pure-torch path and exits 0. Runs with the python that
# holds torch: .venv/bin/python where `make install` made one, else python3 (a GPU machine's own torch,
# transformers, tokenizers, safetensors, click, jinja2, numpy, PyYAML: mtpctl need not be installed, and
# the tokenizer comes from benchmarks/gpu_check_assets/). --help says the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py "$@"
