"""What the GPU data-path tests (``engine.kv_copy``, ``engine.staging``, ``cuda/``) can use here,
shared by the test modules of this folder (imported by name: pytest puts the folder on
``sys.path``; there is deliberately no conftest.py here, so ``from conftest import ...`` in other
folders keeps finding the top-level one).

Every test runs on the CPU; the ``cuda`` variants (marked ``gpu``) skip with a stated reason
where there is no CUDA GPU, or no CuPy able to launch kernels. On a GPU machine, set
``KVSTORE_REQUIRE_GPU=1`` to turn those skips into failures, so that a GPU run which silently
tested nothing on the GPU cannot pass."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# ``engine`` is a top-level folder next to ``kvstore``; make it importable however pytest starts.
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

try:
    import torch
except ImportError:  # every test module here skips itself
    torch = None  # type: ignore[assignment]

REQUIRE_GPU = os.environ.get("KVSTORE_REQUIRE_GPU", "") not in ("", "0")
CUDA_OK = torch is not None and torch.cuda.is_available()


def cupy_reason() -> str:
    """ "" when CuPy can launch kernels here, else why not."""
    from engine.kv_copy import cupy_unusable_reason

    return cupy_unusable_reason()


def skip_or_fail(reason: str) -> None:
    if REQUIRE_GPU:
        pytest.fail(f"KVSTORE_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


def need_cuda(kernels: bool = False) -> None:
    """Skips (or, with KVSTORE_REQUIRE_GPU=1, fails) the calling test without a CUDA GPU, or
    without CuPy kernels when ``kernels``."""
    if not CUDA_OK:
        skip_or_fail("no CUDA GPU")
    if kernels:
        why = cupy_reason()
        if why:
            skip_or_fail(f"no CUDA kernels: {why}")


# Where the copies run: the CPU fallback, the CUDA kernels, and the torch fallback on a GPU
# (what runs where CuPy is missing). Each target is (device, backend).
TARGETS = {
    "cpu": ("cpu", "auto"),
    "cuda": ("cuda", "cuda"),
    "cuda-torch": ("cuda", "torch"),
}


def target_params() -> list:
    return [
        pytest.param("cpu", id="cpu"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
        pytest.param("cuda-torch", id="cuda-torch", marks=pytest.mark.gpu),
    ]
