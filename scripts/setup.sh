#!/usr/bin/env bash
# Creates .venv and installs specdec with what its commands and tests need. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch first: a bare `torch` requirement with nothing installed pulls a multi-GB
# CUDA build. On a GPU machine install the torch you want before running this script.
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${SPECDEC_TORCH_VERSION:-2.13.0}"
fi
python -m pip install -q -e ".[test,ray]"
# Generated protobuf code is produced here, never committed.
python -m specdec.protogen
echo "specdec installed in $(pwd)/.venv"
