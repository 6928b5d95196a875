"""Turning caller buffers into flat byte views without copying.

Accepted: anything with the buffer protocol (bytes, bytearray, memoryview, numpy arrays,
mmap) and torch CPU tensors; each must be C-contiguous. Device memory (CUDA tensors, CuPy
arrays) is refused: the engine stages it through pinned host buffers.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.transport import native

# Copies larger than this run in a worker thread so the event loop stays responsive, and are
# split over ``client.io_threads`` threads (memcpy and xxh3 release the GIL).
INLINE_COPY_BYTES = 8 << 20


def byte_views(objs: Sequence[Any], writable: bool) -> list[np.ndarray]:
    """:func:`byte_view` of each of ``objs`` (errors name ``buffers[i]``); a list of 1-D uint8
    arrays, the common case, is taken as it is after one native check where there is one."""
    out = list(objs)
    if native.impl is not None and native.impl.byte_arrays(out, np.ndarray, writable):
        return out
    return [byte_view(obj, writable, f"buffers[{i}]") for i, obj in enumerate(out)]


def byte_view(obj: Any, writable: bool, what: str = "buffer") -> np.ndarray:
    """A 1-D uint8 numpy view of ``obj``'s bytes (no copy)."""
    if type(obj) is np.ndarray and obj.dtype == np.uint8 and obj.ndim == 1 and obj.flags.c_contiguous:
        if writable and not obj.flags.writeable:
            raise InvalidArgument(f"{what}: array is read-only; get_into needs a writable buffer")
        return obj
    mod = type(obj).__module__
    if mod.startswith("torch"):
        torch = sys.modules["torch"]
        if obj.device.type != "cpu":
            raise InvalidArgument(f"{what}: a {obj.device.type} tensor; pass a CPU tensor (or stage device memory)")
        if not obj.is_contiguous():
            raise InvalidArgument(f"{what}: tensor is not contiguous")
        t = obj.detach().reshape(-1)
        return t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
    if mod.startswith("cupy"):
        raise InvalidArgument(f"{what}: a CuPy device array; pass host memory (or stage device memory)")
    try:
        mv = memoryview(obj)
    except TypeError:
        raise InvalidArgument(f"{what}: {type(obj).__name__} does not support the buffer protocol") from None
    if not mv.c_contiguous:
        raise InvalidArgument(f"{what}: buffer is not C-contiguous")
    if writable and mv.readonly:
        raise InvalidArgument(f"{what}: buffer is read-only ({type(obj).__name__}); get_into needs a writable buffer")
    return np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, dtype=np.uint8)
