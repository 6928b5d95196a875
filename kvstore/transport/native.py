"""The native copy + verify of the read paths (``kvstore/transport/copy.c``), when it was built.

``impl`` is the extension module, or None: then every caller takes its Python path, which gives
the same answers a block at a time. ``KVSTORE_NATIVE=0`` in the environment turns it off.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"kvstore.transport.{name}")
    except ImportError:
        return None


def _cpuinfo_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def _load() -> ModuleType | None:
    """The AVX2 build where the CPU has AVX2 (asked before that build is imported: it may use
    AVX2 while it loads), else the default one, else None."""
    if os.environ.get("KVSTORE_NATIVE", "1") == "0":
        return None
    base = _module("_copy")
    if base.has_avx2() if base is not None else _cpuinfo_avx2():
        fast = _module("_copy_avx2")
        if fast is not None:
            return fast
    return base


impl: ModuleType | None = _load()


def name() -> str:
    """Which implementation reads run on: the module's name, or "python"."""
    return impl.__name__.rsplit(".", 1)[-1] if impl is not None else "python"
