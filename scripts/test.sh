#!/usr/bin/env bash
# Quick start, step 2: set up .venv if needed, then run the test suite (extra arguments go to pytest).
# Fails on any test failure, and also when no test was collected (pytest exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
# the 20 slowest tests close the report: where the suite's time goes
.venv/bin/python -m pytest -q --durations=20 "$@" || status=$?
if [ "$status" = 5 ]; then
  echo "test.sh: no tests were collected" >&2
fi
exit "$status"
