#!/usr/bin/env bash
# Makes .venv and installs kvstore with everything it needs on a fresh machine.
#
#   scripts/setup.sh          # runtime + dev tools (tests, lint, proto generation)
#
# Also redis-server (Debian package, when run as root) for the peer benchmark's Redis baseline.
# torch (for the engine and the torch-buffer tests): the CPU build where there is no GPU
# (torch==2.13.0, a small wheel), the default CUDA build where nvidia-smi finds a GPU.
# KVSTORE_NO_TORCH=1 skips it. Re-running is cheap: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.kvstore-setup
want="$(sha256sum pyproject.toml | cut -c1-16)-${KVSTORE_NO_TORCH:-0}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VPY" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
"$VPY" -m pip install -q --disable-pip-version-check -e ".[dev,bench,engine]"
if [ "${KVSTORE_NO_TORCH:-0}" != "1" ] && ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VPY" -m pip install -q --disable-pip-version-check torch
  else
    "$VPY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  fi
fi
# redis-server: the baseline of the peer benchmark and its test (they skip without it).
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
    || echo "setup: could not install redis-server; the Redis baseline will be skipped" >&2
fi
echo "$want" > "$stamp"
