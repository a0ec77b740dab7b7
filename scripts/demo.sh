#!/usr/bin/env bash
# Quick start, step 1: set up .venv if needed, then run `cpinfer demo` (extra arguments are passed on).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/cpinfer demo "$@"
