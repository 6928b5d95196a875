#!/usr/bin/env bash
# The opt-in SGLang environment (.venv-sglang): sglang 0.5.23 (about 11 GB with its CUDA torch, too
# big for the default set-up) with kvstore and the test tools, for kvstore's HiCache backend
# (kvstore.integrations.sglang) and its tests:
#
#   bash scripts/setup_sglang.sh && .venv-sglang/bin/python -m pytest tests/integrations/test_sglang.py
#
# kvstore goes in without resolving its dependencies again (sglang's own grpcio and protobuf are
# new enough); the few it needs that sglang does not bring are added.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-sglang/bin/python ] || "$PY" -m venv .venv-sglang
VPY=.venv-sglang/bin/python
"$VPY" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
"$VPY" -m pip install -q --disable-pip-version-check "sglang==0.5.23"
"$VPY" -m pip install -q --disable-pip-version-check --no-deps -e .
"$VPY" -m pip install -q --disable-pip-version-check "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1" \
  "lz4>=4.3" "xxhash>=3.4" pytest pytest-timeout pytest-asyncio hypothesis
"$VPY" -c "import sglang.srt.mem_cache.hicache_storage, kvstore.integrations.sglang; print('setup_sglang: ok')"
