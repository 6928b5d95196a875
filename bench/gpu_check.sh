#!/usr/bin/env bash
# The GPU data path checked on one GPU machine, in one go (under 8 minutes on an H200):
# the gpu-marked tests (kernels, streams, pinned staging, CuPy arrays), the engine's GPU tests
# if any, and the copy benchmark (bench/gpu_copy.py -> bench/results/gpu.json, bench/RESULTS.md).
#
#   bash bench/gpu_check.sh                 # from anywhere; runs in the repository root
#   OUT=/some/dir bash bench/gpu_check.sh   # also copies gpu.json, the logs and the summary there
#   PYTHON=/path/to/python bash bench/gpu_check.sh   # use this interpreter as is
#
# Python: $PYTHON if set; else the first of the repository's .venv and the system python3 that
# already has torch with CUDA and CuPy; else a new virtualenv (/tmp/kvstore-gpu-venv, seeing the
# system's site-packages) into which it installs torch, a CuPy build matching the driver's CUDA
# major version (cupy-cuda12x or cupy-cuda13x, read from nvidia-smi), numpy and pytest. Wheels in
# a .whl/ folder at the repository root are used first (pip --no-index --find-links .whl), so a
# machine without a package index can be prepared by copying wheels there; otherwise pip's
# index. The repository itself is installed with `pip install -e .` (falling back to PYTHONPATH
# when it cannot be built there).
#
# Every step has its own time limit; a failed step is reported and the others still run. The
# exit status is 0 only when every step passed. KVSTORE_REQUIRE_GPU=1 is set for the tests, so a
# gpu test that would skip (no GPU, no CuPy) fails instead.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
START=$(date +%s)
LOGS="$(mktemp -d /tmp/kvstore-gpu-check.XXXXXX)"
SUMMARY="$LOGS/summary.txt"
declare -a RESULTS=()
FAILED=0

say() { printf '[gpu_check %4ss] %s\n' "$(($(date +%s) - START))" "$*"; }

BUDGET_S=${KVSTORE_GPU_CHECK_BUDGET_S:-470}  # all steps together stay under 8 minutes

# step NAME LIMIT_S CMD...: runs CMD (a command, or a function of this script) with a time limit
# (never past the overall budget), its output to the terminal and to LOGS/NAME.log
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - ($(date +%s) - START)))
  if [ "$left" -lt 10 ]; then
    RESULTS+=("$name: NOT RUN (time budget of ${BUDGET_S}s spent)")
    FAILED=1
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "== $name (limit ${limit}s): $*"
  local rc=0
  if declare -F "$1" >/dev/null; then
    timeout --kill-after=10 "$limit" bash -c "set -euo pipefail; $(declare -f "$1"); $*" 2>&1 | tee "$LOGS/$name.log" ||
      rc=${PIPESTATUS[0]}
  else
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" || rc=${PIPESTATUS[0]}
  fi
  if [ "$rc" -eq 0 ]; then
    RESULTS+=("$name: ok")
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    RESULTS+=("$name: TIMED OUT after ${limit}s")
    FAILED=1
  else
    RESULTS+=("$name: FAILED (exit $rc)")
    FAILED=1
  fi
  return 0
}

finish() {
  {
    echo "gpu_check summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $(($(date +%s) - START)) s)"
    for r in "${RESULTS[@]}"; do echo "  $r"; done
    if [ -f bench/results/gpu.json ] && [ -n "${PY:-}" ]; then
      "$PY" - <<'EOF' || true
import json
r = json.load(open("bench/results/gpu.json"))
print(f"  kernel_over_memcpy {r['kernel_over_memcpy']} (min {r['kernel_over_memcpy_min']}, goal >= 0.9)")
print(f"  kernel_over_torch  {r['kernel_over_torch']} (min {r['kernel_over_torch_min']}, goal >= 2)")
print(f"  faster staging mode: {r['staging']['faster_mode']} (default in code: {r['staging']['default_in_code']})")
EOF
    fi
  } | tee "$SUMMARY"
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$LOGS"/*.log "$SUMMARY" "$OUT"/ 2>/dev/null || true
    [ -f bench/results/gpu.json ] && cp bench/results/gpu.json "$OUT"/ || true
    say "copied the logs, the summary and gpu.json (if written) to $OUT"
  fi
  say "logs in $LOGS"
}
trap finish EXIT

# -- 1. the machine -----------------------------------------------------------------------------
say "repository: $REPO"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  say "no NVIDIA GPU here (nvidia-smi missing or finds none): nothing to check"
  RESULTS+=("machine: NO GPU")
  FAILED=1
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/  gpu: /'
CUDA_MAJOR=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\)\..*/\1/p' | head -1)
say "driver supports CUDA ${CUDA_MAJOR:-?}"
command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -1 | sed 's/^/  nvcc: /' || say "nvcc: not installed (the kernels compile through NVRTC)"

# -- 2. Python with torch (CUDA) and CuPy --------------------------------------------------------
has_stack() {  # python has torch seeing a GPU and CuPy seeing one
  timeout 120 "$1" -c "import torch, cupy; assert torch.cuda.is_available() and cupy.is_available()" >/dev/null 2>&1
}
PY=""
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ] && has_stack .venv/bin/python; then
  PY=.venv/bin/python
elif command -v python3 >/dev/null 2>&1 && has_stack "$(command -v python3)"; then
  PY=$(command -v python3)
else
  VENV=/tmp/kvstore-gpu-venv
  say "no interpreter with torch (CUDA) and CuPy: making $VENV"
  python3 -m venv --system-site-packages "$VENV"
  PY=$VENV/bin/python
  CUPY=cupy-cuda12x
  [ "${CUDA_MAJOR:-12}" -ge 13 ] 2>/dev/null && CUPY=cupy-cuda13x
  export PY CUPY
  install_stack() {
    local find=()
    [ -d .whl ] && find=(--find-links .whl) && echo "using wheels from .whl/"
    "$PY" -m pip install -q --disable-pip-version-check "${find[@]}" --no-index torch numpy pytest "$CUPY" ||
      "$PY" -m pip install -q --disable-pip-version-check --retries 1 --timeout 15 "${find[@]}" torch numpy pytest "$CUPY"
  }
  step setup-python 300 install_stack
fi
export PY
say "python: $PY"

# the repository: pip install -e . (its dependencies from .whl/ or the index), else PYTHONPATH
install_repo() {
  local find=()
  [ -d .whl ] && find=(--find-links .whl)
  if "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation "${find[@]}" --no-index -e . ||
    "$PY" -m pip install -q --disable-pip-version-check --retries 1 --timeout 15 --no-build-isolation "${find[@]}" -e .; then
    return 0
  fi
  echo "pip install -e . failed here: using PYTHONPATH=$PWD instead"
  PYTHONPATH=$PWD "$PY" -c "import kvstore" # its dependencies must be importable all the same
}
step install-repo 180 install_repo
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

versions() {
  "$PY" - <<'EOF'
import platform, sys
print("python", platform.python_version(), sys.executable)
import numpy, torch
print("numpy", numpy.__version__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs", round(p.total_memory / 2**30), "GiB")
import cupy
print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())
import pytest
print("pytest", pytest.__version__)
import kvstore
from engine import kv_copy
why = kv_copy.kernels_unavailable_reason(0)
print("kv_copy kernels:", "compiled" if not why else why)
sys.exit(1 if why else 0)
EOF
}
step versions 180 versions

# -- 3. tests -------------------------------------------------------------------------------------
export KVSTORE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
step pytest-gpu 300 "$PY" -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider

engine_gpu_tests() {
  local rc=0
  "$PY" -m pytest tests/engine -k gpu -q -rs -p no:cacheprovider || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "no engine GPU tests (nothing matched -k gpu): skipped"
    return 0
  fi
  return "$rc"
}
if [ -d tests/engine ]; then
  step pytest-engine-gpu 240 engine_gpu_tests
else
  RESULTS+=("pytest-engine-gpu: skipped (no tests/engine)")
fi

# -- 4. benchmark ---------------------------------------------------------------------------------
step bench-gpu-copy 300 "$PY" bench/gpu_copy.py

[ "$FAILED" -eq 0 ] && say "all steps passed" || say "some steps FAILED"
exit "$FAILED"
