"""Host staging buffers for KV transfers: one region allocated and touched once, cut into
fixed-size slabs that are handed out and taken back, never freed or reallocated per request.

On a machine with a GPU (CuPy usable) the region is pinned host memory from
``cupy.cuda.alloc_pinned_memory``: device copies into and out of it run asynchronously at the
host link's full speed, and, because under unified addressing pinned memory is mapped into
every device's address space, the copy kernels can read and write it directly
(``engine.kv_copy``'s ``mode="mapped"``). Without a GPU the region is ordinary page-aligned
anonymous memory (``mmap``) with the same API, so the same code runs on a CPU-only host.

A slab is seen without copies as a numpy array (what the store client takes: any buffer-protocol
object) or as a torch tensor::

    pool = StagingPool(slab_bytes=64 * block_nbytes, num_slabs=8)
    with pool.acquire() as slab:                       # released on exit
        buf = slab.torch(cache.dtype, (n, *block_shape))
        kv_copy.gather(cache, ids, out=buf, stream=pool.stream)   # GPU -> slab on the pool's stream
        pool.synchronize()
        store.put(keys, list(slab.numpy(np.uint8, (n, block_nbytes))))

GPU copies go on the pool's own CUDA stream (``pool.stream``), so they overlap compute on the
default stream. A slab released with ``release(stream=...)`` (or ``slab.release(stream=...)``)
is not handed out again until the work enqueued on that stream before the release has finished.
"""

from __future__ import annotations

import mmap
import threading
from typing import Any

import numpy as np

PAGE = mmap.PAGESIZE


def _gpu_reason() -> str:
    """ "" when CuPy can allocate pinned memory here, else why not."""
    try:
        import cupy
    except Exception as e:
        return f"CuPy is not importable: {type(e).__name__}: {e}"
    try:
        if not cupy.is_available():
            return "CuPy sees no usable CUDA device"
    except Exception as e:
        return f"CuPy cannot reach a CUDA device: {e}"
    return ""


def _stream_ptr(stream: Any) -> int:
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    for attr in ("ptr", "cuda_stream"):  # CuPy, torch
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    raise ValueError(f"stream must be a CuPy or torch CUDA stream or a raw handle, got {type(stream).__name__}")


class Slab:
    """One fixed-size piece of a :class:`StagingPool`, valid from ``acquire`` until ``release``."""

    __slots__ = ("pool", "index", "offset", "nbytes", "_bytes", "_held")

    def __init__(self, pool: StagingPool, index: int, offset: int, nbytes: int, raw: np.ndarray) -> None:
        self.pool = pool
        self.index = index
        self.offset = offset
        self.nbytes = nbytes
        self._bytes = raw
        self._held = False

    @property
    def address(self) -> int:
        """The slab's first byte (page-aligned; for a pinned pool also its device-visible address)."""
        return self.pool.base_address + self.offset

    @property
    def pinned(self) -> bool:
        return self.pool.pinned

    def _check(self) -> None:
        if not self._held:
            raise ValueError(f"slab {self.index} is not held (released, or never acquired)")

    def numpy(self, dtype: Any = np.uint8, shape: tuple[int, ...] | int | None = None) -> np.ndarray:
        """A numpy view of the slab's leading bytes (the whole slab when ``shape`` is None)."""
        self._check()
        dtype = np.dtype(dtype)
        if shape is None:
            return self._bytes.view(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if need > self.nbytes:
            raise ValueError(f"shape {shape} of {dtype} needs {need} bytes, the slab holds {self.nbytes}")
        return self._bytes[:need].view(dtype).reshape(shape)

    def torch(self, dtype: Any = None, shape: tuple[int, ...] | int | None = None):
        """A torch CPU tensor over the slab's leading bytes (bf16 included); shares memory with
        :meth:`numpy`. On a pinned pool ``tensor.is_pinned()`` is True."""
        import torch

        self._check()
        dtype = torch.uint8 if dtype is None else dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        if shape is None:
            raw = self._bytes[: self.nbytes - self.nbytes % itemsize]
            return torch.from_numpy(raw).view(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        need = int(np.prod(shape, dtype=np.int64)) * itemsize
        if need > self.nbytes:
            raise ValueError(f"shape {shape} of {dtype} needs {need} bytes, the slab holds {self.nbytes}")
        return torch.from_numpy(self._bytes[:need]).view(dtype).view(shape)

    @property
    def memoryview(self) -> memoryview:
        self._check()
        return memoryview(self._bytes)

    def release(self, stream: Any = None) -> None:
        self.pool.release(self, stream=stream)

    def __enter__(self) -> Slab:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._held:
            self.pool.release(self)

    def __repr__(self) -> str:
        return f"Slab(index={self.index}, address={self.address:#x}, nbytes={self.nbytes}, pinned={self.pinned})"


class StagingPool:
    """``num_slabs`` slabs of ``slab_bytes`` (rounded up to ``alignment``, a page by default) in one
    region allocated and touched at construction.

    ``pinned``: None picks pinned memory where CuPy has a GPU and ``mmap`` elsewhere; True insists
    on pinned memory (RuntimeError without a GPU); False always uses ``mmap``. ``device`` is the
    GPU whose context allocates the pinned memory and owns ``stream`` (default: CuPy's current).
    """

    def __init__(
        self,
        slab_bytes: int,
        num_slabs: int,
        *,
        pinned: bool | None = None,
        device: int | None = None,
        alignment: int = PAGE,
    ) -> None:
        for name, v in (("slab_bytes", slab_bytes), ("num_slabs", num_slabs), ("alignment", alignment)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"StagingPool {name} must be a positive int, got {v!r}")
        if alignment & (alignment - 1) or alignment < 16:
            raise ValueError(f"StagingPool alignment must be a power of two >= 16, got {alignment}")
        why = _gpu_reason() if pinned is not False else "pinned=False"
        if pinned and why:
            raise RuntimeError(f"pinned staging needs a GPU: {why}")
        self.pinned = not why
        self.why_not_pinned = why
        self.slab_bytes = -(-slab_bytes // alignment) * alignment
        self.num_slabs = num_slabs
        self.alignment = alignment
        self.nbytes = self.slab_bytes * num_slabs
        self._stream = None
        self._closed = False
        self._cond = threading.Condition()
        self._pending: dict[int, Any] = {}  # slab index -> CuPy event recorded at release

        if self.pinned:
            import cupy

            self.device = int(cupy.cuda.runtime.getDevice() if device is None else device)
            with cupy.cuda.Device(self.device):
                # cudaHostAlloc memory is page-aligned; over-allocate anyway so any alignment holds
                self._mem = cupy.cuda.alloc_pinned_memory(self.nbytes + alignment)
            whole = np.frombuffer(self._mem, dtype=np.uint8, count=self.nbytes + alignment)
        else:
            self.device = None
            self._mem = mmap.mmap(-1, self.nbytes + alignment, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:  # huge pages fault in many times faster than 4 KiB ones
                self._mem.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError, ValueError):
                pass
            whole = np.frombuffer(self._mem, dtype=np.uint8, count=self.nbytes + alignment)
        start = (-whole.ctypes.data) % alignment
        self._region = whole[start : start + self.nbytes]
        self.base_address = int(self._region.ctypes.data)
        self._region[::PAGE] = 0  # touch every page once, now rather than on the first request
        self._region[-1:] = 0
        self._slabs = [
            Slab(
                self,
                i,
                i * self.slab_bytes,
                self.slab_bytes,
                self._region[i * self.slab_bytes : (i + 1) * self.slab_bytes],
            )
            for i in range(num_slabs)
        ]
        self._free = list(reversed(range(num_slabs)))  # a stack: the slab released last is reused first

    # -- slabs ----------------------------------------------------------------------------------

    @property
    def free_slabs(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> Slab:
        """A free slab; waits up to ``timeout`` seconds (forever when None) for one to be released,
        then raises TimeoutError. Usable as a context manager that releases it."""
        with self._cond:
            if self._closed:
                raise ValueError("StagingPool is closed")
            if not self._cond.wait_for(lambda: self._free or self._closed, timeout=timeout):
                raise TimeoutError(f"no free staging slab within {timeout} s ({self.num_slabs} slabs, all held)")
            if self._closed:
                raise ValueError("StagingPool is closed")
            index = self._free.pop()
            event = self._pending.pop(index, None)
            slab = self._slabs[index]
            slab._held = True
        if event is not None:
            event.synchronize()  # copies that were still in flight at release have finished
        return slab

    def release(self, slab: Slab, stream: Any = None) -> None:
        """Returns ``slab``. With ``stream`` (a GPU pool), the slab is handed out again only after
        the work enqueued on that stream so far has finished."""
        if not isinstance(slab, Slab) or slab.pool is not self:
            raise ValueError("slab does not belong to this StagingPool")
        event = None
        if stream is not None and self.pinned:
            import cupy

            from engine.kv_copy import _cupy_stream

            event = cupy.cuda.Event(block=False, disable_timing=True)
            with cupy.cuda.Device(self.device):
                event.record(_cupy_stream(_stream_ptr(stream), self.device))
        with self._cond:
            if not slab._held:
                raise ValueError(f"slab {slab.index} released twice")
            slab._held = False
            if event is not None:
                self._pending[slab.index] = event
            self._free.append(slab.index)
            self._cond.notify()

    def close(self) -> None:
        """Wakes waiters with an error and drops the region (freed once no view of it is left)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.synchronize()

    def __enter__(self) -> StagingPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the copy stream ------------------------------------------------------------------------

    @property
    def stream(self):
        """The pool's own CUDA stream (a non-blocking ``cupy.cuda.Stream``), or None without a GPU.
        Pass it as ``stream=`` to ``engine.kv_copy.gather`` / ``scatter``."""
        if not self.pinned:
            return None
        if self._stream is None:
            import cupy

            with cupy.cuda.Device(self.device):
                self._stream = cupy.cuda.Stream(non_blocking=True)
        return self._stream

    @property
    def torch_stream(self):
        """:attr:`stream` as a ``torch.cuda.ExternalStream`` (for ``with torch.cuda.stream(...)``)."""
        if not self.pinned:
            return None
        import torch

        return torch.cuda.ExternalStream(self.stream.ptr, device=torch.device("cuda", self.device))

    def synchronize(self) -> None:
        """Waits for everything enqueued on :attr:`stream`."""
        if self._stream is not None:
            self._stream.synchronize()

    def _after(self, after: Any, device_index: int) -> None:
        """Makes the pool's stream wait for what was enqueued on ``after`` (default: torch's current
        stream on that device) so far."""
        import cupy

        from engine.kv_copy import _cupy_stream

        if after is None:
            import torch

            after = torch.cuda.current_stream(device_index)
        ptr = _stream_ptr(after)
        if ptr == self.stream.ptr:
            return
        event = cupy.cuda.Event(block=False, disable_timing=True)
        with cupy.cuda.Device(device_index):
            event.record(_cupy_stream(ptr, device_index))
        self.stream.wait_event(event)

    def _device_buffer(self, buf: Any, what: str, nbytes: int | None, slab: Slab) -> tuple[int, int, int | None]:
        """(address, byte count, CUDA device or None for host) of a contiguous tensor/array."""
        import torch

        if isinstance(buf, np.ndarray):
            t = torch.from_numpy(buf)
        elif isinstance(buf, torch.Tensor):
            t = buf
        else:
            t = torch.from_dlpack(buf)
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        size = t.numel() * t.element_size() if nbytes is None else nbytes
        if size > t.numel() * t.element_size() or size > slab.nbytes:
            raise ValueError(
                f"{what}: {size} bytes do not fit ({t.numel() * t.element_size()} in {what}, {slab.nbytes} in the slab)"
            )
        return t.data_ptr(), size, (t.device.index if t.device.type == "cuda" else None)

    def copy_to_host(self, slab: Slab, src: Any, *, nbytes: int | None = None, after: Any = None):
        """Copies ``src`` (a contiguous CUDA tensor or CuPy array; a CPU one on a host-only pool) into
        the slab's leading bytes on :attr:`stream`, after the work on ``after`` (default: the current
        torch stream). Returns a CuPy event that completes with the copy (None when the copy was
        done synchronously on the CPU)."""
        slab._check()
        ptr, size, dev = self._device_buffer(src, "src", nbytes, slab)
        if dev is None:
            import ctypes

            ctypes.memmove(slab.address, ptr, size)
            return None
        return self._copy(slab.address, ptr, size, dev, after)

    def copy_to_device(self, slab: Slab, dst: Any, *, nbytes: int | None = None, after: Any = None):
        """Copies the slab's leading bytes into ``dst`` (contiguous CUDA tensor or CuPy array) on
        :attr:`stream`, after the work on ``after``. Returns a CuPy event (None on the CPU path)."""
        slab._check()
        ptr, size, dev = self._device_buffer(dst, "dst", nbytes, slab)
        if dev is None:
            import ctypes

            ctypes.memmove(ptr, slab.address, size)
            return None
        return self._copy(ptr, slab.address, size, dev, after)

    def _copy(self, dst: int, src: int, size: int, dev: int, after: Any):
        import cupy

        if not self.pinned:
            raise ValueError("a host-only (mmap) StagingPool cannot copy to or from a GPU")
        self._after(after, dev)
        with cupy.cuda.Device(dev):
            cupy.cuda.runtime.memcpyAsync(dst, src, size, cupy.cuda.runtime.memcpyDefault, self.stream.ptr)
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record(self.stream)
        return event

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "mmap"
        return f"StagingPool({self.num_slabs} x {self.slab_bytes} bytes, {kind}, {self.free_slabs} free)"
