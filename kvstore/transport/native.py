"""The native copy + verify of the read paths (``kvstore/transport/copy.c``), when it was built.

``impl`` is the extension module, or None: then every caller takes its Python path, which gives
the same answers a block at a time. ``KVSTORE_NATIVE=0`` in the environment turns it off.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("KVSTORE_NATIVE", "1") == "0":
        return None
    for name in ("_copy_avx2", "_copy"):
        try:
            mod = importlib.import_module(f"kvstore.transport.{name}")
        except ImportError:
            continue
        if mod.cpu_ok():
            return mod
    return None


impl: ModuleType | None = _load()


def name() -> str:
    """Which implementation reads run on: the module's name, or "python"."""
    return impl.__name__.rsplit(".", 1)[-1] if impl is not None else "python"
