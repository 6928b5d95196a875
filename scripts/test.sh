#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the whole test suite.
#   scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
