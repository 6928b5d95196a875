#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the embedded store with a short multi-turn
# workload that shows prefix reuse.
#   scripts/demo.sh [kvstore demo args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvstore demo "$@"
