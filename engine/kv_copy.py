"""Moving KV blocks between the paged cache and contiguous staging buffers.

The cache is one contiguous tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` (see ``engine.kv_cache``), so block ``b`` is one contiguous run ``cache[b]`` and its
layer ``l`` is the run ``cache[b, l]``. Two operations, each for whole blocks (all layers in one
launch) or for one layer of each block (so a load can overlap compute layer by layer)::

    out = gather(cache, block_ids)                 # save:  out[i] = cache[block_ids[i]]
    gather(cache, block_ids, out=buf, layer=3)     #        buf[i] = cache[block_ids[i], 3]
    scatter(cache, block_ids, src)                 # load:  cache[block_ids[i]] = src[i]
    scatter(cache, block_ids, src, layer=3)        #        cache[block_ids[i], 3] = src[i]

Backends, chosen per call from where the cache lives:

- **CUDA kernels** (``cuda/kv_copy.cu``, compiled once per device and process through CuPy's
  ``RawModule``; CuPy also keeps the binary in its on-disk cache): a CUDA cache and CuPy
  usable. Tensors are used in place (torch tensors directly, CuPy and other DLPack arrays through
  ``torch.from_dlpack``: no copies). The copy is enqueued on ``stream`` (default: the current
  stream) and the call returns without waiting for it.
- **torch**: a CPU cache (``index_select`` / ``index_copy_``), or a CUDA cache where CuPy is
  missing or unusable (the same torch calls on the GPU). Same signatures, same checks, same
  results.

Every argument is checked before anything is launched or written: an out-of-range or negative
block id, a layer outside the cache, a wrong shape, dtype, device or a non-contiguous buffer
raises :class:`engine.errors.InvalidRequest` (a ``ValueError``) naming what is wrong, and the
cache is left untouched. Scatter refuses duplicate block ids (two writes to one block would
race). Block ids given on the host (a list, numpy array or CPU tensor) are checked there and
copied to the device asynchronously (through pinned memory); ids already on the GPU are checked
by reading their min and max back, one small synchronisation: pass host ids when that matters.

**Host staging.** When the cache is on a GPU and ``out`` (gather) or ``src`` (scatter) is host
memory, the copy crosses to the host in one of two ways (``mode``):

- ``"device"`` (the default): the kernel gathers into a contiguous device scratch buffer, then
  one ``cudaMemcpyAsync`` moves it to the host (scatter: one ``cudaMemcpyAsync`` to the device,
  then the kernel). Works for any host memory; asynchronous when it is pinned.
- ``"mapped"``: the kernel reads or writes pinned host memory directly (zero-copy over the host
  link, through the buffer's device-side address: the same address under unified addressing).
  The host buffer must be pinned (``engine.staging.StagingPool`` hands out such slabs). The
  torch fallback has no such mode: it always copies through the device.

``DEFAULT_STAGING_MODE`` is ``"device"``, chosen before any GPU measurement: it works with any host
memory, the host link then moves one large contiguous ``cudaMemcpyAsync`` (the copy engines'
best case), and the extra on-device pass costs little (HBM is tens of times faster than the
host link). ``bench/gpu_copy.py`` measures both modes against a plain ``cudaMemcpyAsync`` of the
same bytes and reports the faster one (``bench/results/gpu.json``, ``staging.faster_mode``); the
default follows that measurement once it has been made on the target GPU.

With host staging the call returns once the copies are enqueued: synchronise ``stream`` (or an
event recorded on it) before reading ``out`` or reusing ``src``.
"""

from __future__ import annotations

import math
import operator
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import InvalidRequest

CU_SOURCE = Path(__file__).resolve().parent.parent / "cuda" / "kv_copy.cu"
"""The kernels' source, loaded by path (``cuda/`` is deliberately not a Python package)."""

THREADS = 256  # KV_COPY_THREADS in the .cu
UNROLL = 4  # KV_COPY_UNROLL in the .cu
CHUNK_BYTES = THREADS * UNROLL * 16  # bytes one CTA moves per row: grid.x = ceil(row_bytes / CHUNK_BYTES)
MAX_GRID_Y = 65535  # rows beyond this are covered by the kernels' grid-stride loop
NVRTC_OPTIONS = ("-std=c++17",)

STAGING_MODES = ("device", "mapped")
DEFAULT_STAGING_MODE = "device"
BACKENDS = ("auto", "cuda", "torch")

DTYPE_TAGS = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
INDEX_TAGS = {torch.int32: "i32", torch.int64: "i64"}


def kernel_name(op: str, granularity: str, dtype: torch.dtype, index_dtype: torch.dtype) -> str:
    """``kv_{gather,scatter}_{blocks,layer}_{f16,bf16,f32}_{i32,i64}``: the .cu's entry points."""
    return f"kv_{op}_{granularity}_{DTYPE_TAGS[dtype]}_{INDEX_TAGS[index_dtype]}"


KERNEL_NAMES = tuple(
    kernel_name(op, gran, dt, it)
    for op in ("gather", "scatter")
    for gran in ("blocks", "layer")
    for dt in DTYPE_TAGS
    for it in INDEX_TAGS
)

# ---------------------------------------------------------------------------------------------
# CuPy: availability, the compiled module (one per device per process), streams
# ---------------------------------------------------------------------------------------------

_lock = threading.Lock()
_cupy_state: dict[str, Any] = {}
_modules: dict[int, Any] = {}
_functions: dict[tuple[int, str], Any] = {}
_streams: dict[tuple[int, int], Any] = {}


def cupy_usable() -> bool:
    """True when CuPy imports and sees a GPU it can launch on (checked once per process)."""
    with _lock:
        if "usable" not in _cupy_state:
            try:
                import cupy

                _cupy_state["usable"] = bool(cupy.is_available())
                _cupy_state["why"] = "" if _cupy_state["usable"] else "CuPy sees no usable CUDA device"
            except Exception as e:  # ImportError, or a CUDA library that fails to load
                _cupy_state["usable"] = False
                _cupy_state["why"] = f"CuPy is not importable: {type(e).__name__}: {e}"
        return _cupy_state["usable"]


def cupy_unusable_reason() -> str:
    """Why :func:`cupy_usable` is False ("" when it is True)."""
    cupy_usable()
    return _cupy_state["why"]


def load_module(device: int | torch.device | None = None):
    """The compiled ``cuda/kv_copy.cu`` for ``device`` (a ``cupy.RawModule``), compiled on first use."""
    import cupy

    dev = _device_index(device)
    with _lock:
        mod = _modules.get(dev)
        if mod is None:
            source = CU_SOURCE.read_text()
            with cupy.cuda.Device(dev):
                mod = cupy.RawModule(code=source, options=NVRTC_OPTIONS)
                mod.compile()
            _modules[dev] = mod
        return mod


def _function(dev: int, name: str):
    fn = _functions.get((dev, name))
    if fn is None:
        fn = load_module(dev).get_function(name)
        with _lock:
            _functions[(dev, name)] = fn
    return fn


def _device_index(device: int | torch.device | None) -> int:
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else 0
    if isinstance(device, torch.device):
        return device.index if device.index is not None else torch.cuda.current_device()
    return int(device)


class _StreamHandle:
    """A bare ``cudaStream_t`` that speaks the CUDA stream protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _cupy_stream(handle: int, dev: int):
    """A CuPy stream object for a raw handle (no ownership), cached per (device, handle)."""
    import cupy

    if handle == 0:
        return cupy.cuda.Stream.null
    key = (dev, handle)
    s = _streams.get(key)
    if s is None:
        with cupy.cuda.Device(dev):
            try:  # CuPy >= 14: the CUDA stream protocol
                s = cupy.cuda.Stream.from_external(_StreamHandle(handle))
            except (AttributeError, TypeError):  # older CuPy
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    s = cupy.cuda.ExternalStream(handle, dev)
        with _lock:
            if len(_streams) > 256:
                _streams.clear()
            _streams[key] = s
    return s


def stream_handle(stream: Any, device: torch.device) -> int:
    """The raw ``cudaStream_t`` of ``stream``: None (the current torch stream on ``device``), a
    ``torch.cuda.Stream``, a CuPy stream, anything with ``__cuda_stream__``, or an int."""
    if stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    if isinstance(stream, torch.cuda.Stream):
        return stream.cuda_stream
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    if hasattr(stream, "ptr"):  # cupy.cuda.Stream / ExternalStream
        return int(stream.ptr)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    raise InvalidRequest(
        f"stream must be a torch or CuPy CUDA stream, a raw handle or None, got {type(stream).__name__}"
    )


# ---------------------------------------------------------------------------------------------
# Argument checks (all before any launch or write)
# ---------------------------------------------------------------------------------------------


def _as_tensor(x: Any, what: str) -> tuple[torch.Tensor, str]:
    """``x`` as a torch tensor sharing its memory, and what it was: torch, numpy or dlpack."""
    if isinstance(x, torch.Tensor):
        return x, "torch"
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:
            # torch.from_numpy warns on read-only arrays; a gather target must be writable anyway
            if what == "out":
                raise InvalidRequest("out is a read-only numpy array")
            x = x.copy() if x.size else np.empty(x.shape, x.dtype)
        try:
            return torch.from_numpy(x), "numpy"
        except TypeError as e:
            raise InvalidRequest(f"{what}: numpy dtype {x.dtype} has no torch equivalent") from e
    if hasattr(x, "__dlpack__"):
        try:
            return torch.from_dlpack(x), "dlpack"
        except Exception as e:
            raise InvalidRequest(f"{what}: cannot take {type(x).__name__} through DLPack: {e}") from e
    raise InvalidRequest(
        f"{what} must be a torch tensor, a CuPy (DLPack) array or a numpy array, got {type(x).__name__}"
    )


def _check_cache(cache: Any) -> tuple[torch.Tensor, str]:
    t, kind = _as_tensor(cache, "cache")
    if t.dtype not in DTYPE_TAGS:
        raise InvalidRequest(f"cache dtype must be one of float16, bfloat16, float32, got {t.dtype}")
    if t.dim() < 2:
        raise InvalidRequest(f"cache must be [num_blocks, num_layers, ...], got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise InvalidRequest(f"cache is empty (shape {tuple(t.shape)})")
    if not t.is_contiguous():
        raise InvalidRequest("cache must be contiguous: block b is the run cache[b]")
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidRequest(f"cache must be on the CPU or a CUDA GPU, got {t.device}")
    return t, kind


def _check_layer(layer: Any, num_layers: int) -> int | None:
    if layer is None:
        return None
    if isinstance(layer, bool):
        raise InvalidRequest(f"layer must be an int or None, got {layer!r}")
    try:
        layer = operator.index(layer)
    except TypeError:
        raise InvalidRequest(f"layer must be an int or None, got {type(layer).__name__}") from None
    if not 0 <= layer < num_layers:
        raise InvalidRequest(f"layer {layer} is outside [0, {num_layers})")
    return layer


def _range_error(ids: np.ndarray | torch.Tensor, num_blocks: int) -> InvalidRequest:
    bad_mask = (ids < 0) | (ids >= num_blocks)
    pos = int(bad_mask.nonzero()[0][0]) if isinstance(ids, np.ndarray) else int(bad_mask.nonzero()[0, 0])
    return InvalidRequest(f"block id {int(ids[pos])} (position {pos}) is outside [0, {num_blocks})")


def _check_ids(block_ids: Any, num_blocks: int, *, unique: bool) -> torch.Tensor:
    """A contiguous 1-D int32 or int64 tensor (where the ids were given: host, or a GPU) with every id
    in [0, num_blocks), distinct when ``unique``. int32 stays int32 (the kernels take both); other
    integer types become int64."""
    if isinstance(block_ids, torch.Tensor | np.ndarray) or hasattr(block_ids, "__dlpack__"):
        if isinstance(block_ids, np.ndarray):
            arr = block_ids
            if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
                raise InvalidRequest(f"block ids must be integers, got numpy {arr.dtype}")
            if arr.ndim != 1:
                raise InvalidRequest(f"block ids must be 1-D, got shape {arr.shape}")
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_blocks):
                raise _range_error(arr.astype(np.int64) if arr.dtype.kind == "i" else arr, num_blocks)
            t = torch.from_numpy(np.ascontiguousarray(arr.astype(np.int32 if arr.dtype == np.int32 else np.int64)))
        else:
            t = block_ids if isinstance(block_ids, torch.Tensor) else _as_tensor(block_ids, "block_ids")[0]
            if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
                raise InvalidRequest(f"block ids must be integers, got {t.dtype}")
            if t.dim() != 1:
                raise InvalidRequest(f"block ids must be 1-D, got shape {tuple(t.shape)}")
            if t.numel():
                lo, hi = (int(v) for v in torch.stack([t.min().long(), t.max().long()]).tolist())
                if lo < 0 or hi >= num_blocks:
                    raise _range_error(t.long(), num_blocks)
            if t.dtype not in INDEX_TAGS:
                t = t.long()
    else:
        if isinstance(block_ids, str | bytes) or not isinstance(block_ids, Sequence | range):
            raise InvalidRequest(
                f"block ids must be a sequence of ints or an integer array, got {type(block_ids).__name__}"
            )
        vals = []
        for pos, v in enumerate(block_ids):
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise InvalidRequest(f"block ids must be ints, got {type(v).__name__} at position {pos}")
            v = int(v)
            if not 0 <= v < num_blocks:
                raise InvalidRequest(f"block id {v} (position {pos}) is outside [0, {num_blocks})")
            vals.append(v)
        t = torch.tensor(vals, dtype=torch.int64)
    if unique and t.numel() > 1:
        u, counts = torch.unique(t, return_counts=True)
        if int(counts.max()) > 1:
            dup = int(u[counts > 1][0])
            raise InvalidRequest(f"block id {dup} appears more than once: a scatter writes each block once")
    return t.contiguous()


def _check_buffer(
    buf: Any, what: str, cache_t: torch.Tensor, shape: tuple[int, ...], *, writable: bool
) -> tuple[torch.Tensor, bool]:
    """``buf`` as a typed contiguous tensor of ``shape`` and the cache's dtype, and whether it is host
    memory that must cross to (or from) a GPU cache. A uint8 buffer of exactly the right byte count
    (a raw staging slab) is viewed as the cache's dtype and shape."""
    t, kind = _as_tensor(buf, what)
    if kind == "numpy" and writable and not buf.flags.writeable:
        raise InvalidRequest(f"{what} is read-only")
    nbytes = math.prod(shape) * cache_t.element_size()
    if t.dtype == torch.uint8 and cache_t.dtype != torch.uint8:
        if not t.is_contiguous():
            raise InvalidRequest(f"{what} must be contiguous")
        if t.numel() != nbytes:
            raise InvalidRequest(
                f"{what} holds {t.numel()} bytes, expected {nbytes} for shape {shape} of {cache_t.dtype}"
            )
        if t.data_ptr() % cache_t.element_size():
            raise InvalidRequest(f"{what} is not aligned to {cache_t.element_size()} bytes")
        t = t.reshape(-1).view(cache_t.dtype).view(shape)
    else:
        if t.dtype != cache_t.dtype:
            raise InvalidRequest(f"{what} dtype must match the cache ({cache_t.dtype}), got {t.dtype}")
        if tuple(t.shape) != shape:
            raise InvalidRequest(f"{what} shape must be {shape}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise InvalidRequest(f"{what} must be contiguous")
    if t.device == cache_t.device:
        return t, False
    if cache_t.device.type == "cuda" and t.device.type == "cpu":
        return t, True
    raise InvalidRequest(f"{what} is on {t.device}, the cache on {cache_t.device}")


def _check_mode(mode: str | None) -> str:
    mode = DEFAULT_STAGING_MODE if mode is None else mode
    if mode not in STAGING_MODES:
        raise InvalidRequest(f"mode must be one of {STAGING_MODES}, got {mode!r}")
    return mode


def _mapped_pointer(t: torch.Tensor) -> int | None:
    """The device-side address of host tensor ``t`` when it is pinned (page-locked and mapped: with
    unified addressing, the same address), else None."""
    try:
        import cupy

        attrs = cupy.cuda.runtime.pointerGetAttributes(t.data_ptr())
        if attrs.type == cupy.cuda.runtime.memoryTypeHost and attrs.devicePointer:
            return int(attrs.devicePointer)
    except Exception:  # not CUDA memory at all (pageable), or no CuPy
        pass
    return t.data_ptr() if t.is_pinned() else None


def _use_kernels(cache_t: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise InvalidRequest(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or cache_t.device.type != "cuda":
        if backend == "cuda":
            raise InvalidRequest(f"backend='cuda' needs a cache on a CUDA GPU, the cache is on {cache_t.device}")
        return False
    why = kernels_unavailable_reason(cache_t.device.index)
    if not why:
        return True
    if backend == "cuda":
        raise RuntimeError(f"backend='cuda' asked for, but {why}")
    return False


def kernels_unavailable_reason(device: int | torch.device | None = None) -> str:
    """ "" when the CUDA kernels are compiled (or compile now) for ``device``, else why not. A
    failure is reported once as a RuntimeWarning; ``backend="auto"`` then uses torch."""
    if not cupy_usable():
        return cupy_unusable_reason()
    dev = _device_index(device)
    key = f"compile:{dev}"
    if key not in _cupy_state:
        try:
            load_module(dev)
            _cupy_state[key] = ""
        except Exception as e:  # no NVRTC, or a compile error
            _cupy_state[key] = f"cuda/kv_copy.cu does not compile on device {dev}: {type(e).__name__}: {e}"
            warnings.warn(_cupy_state[key] + "; falling back to torch", RuntimeWarning, stacklevel=3)
    return _cupy_state[key]


def _row_shape(cache_t: torch.Tensor, layer: int | None) -> tuple[int, ...]:
    return tuple(cache_t.shape[1:]) if layer is None else tuple(cache_t.shape[2:])


# ---------------------------------------------------------------------------------------------
# The copies
# ---------------------------------------------------------------------------------------------


def launch_plan(
    op: str, cache_t: torch.Tensor, buf_ptr: int, ids_t: torch.Tensor, layer: int | None
) -> tuple[str, tuple[int, int, int], tuple[int, int, int], tuple[int, ...]]:
    """(kernel name, grid, block, arguments) of one copy: one CTA per ``CHUNK_BYTES`` of a row
    along x, one row per CTA along y (capped; the kernels loop over the rest). Arguments in the
    kernels' order: cache, staging, ids pointers, then rows, num_blocks, block_bytes[, layer,
    layer_bytes]."""
    n = ids_t.numel()
    num_blocks, num_layers = cache_t.shape[0], cache_t.shape[1]
    block_bytes = cache_t.stride(0) * cache_t.element_size()
    row_bytes = block_bytes if layer is None else block_bytes // num_layers
    name = kernel_name(op, "blocks" if layer is None else "layer", cache_t.dtype, ids_t.dtype)
    grid = (max(1, -(-row_bytes // CHUNK_BYTES)), max(1, min(n, MAX_GRID_Y)), 1)
    args = (cache_t.data_ptr(), buf_ptr, ids_t.data_ptr(), n, num_blocks, block_bytes)
    if layer is not None:
        args += (layer, row_bytes)
    return name, grid, (THREADS, 1, 1), args


def _launch(op: str, cache_t: torch.Tensor, buf_ptr: int, ids_t: torch.Tensor, layer: int | None, handle: int) -> None:
    import cupy

    dev = cache_t.device.index
    name, grid, block, args = launch_plan(op, cache_t, buf_ptr, ids_t, layer)
    fn = _function(dev, name)
    # pointers as 8-byte unsigned, sizes as 8-byte signed: exactly the kernels' parameter types
    packed = tuple(np.uint64(a) for a in args[:3]) + tuple(np.int64(a) for a in args[3:])
    with cupy.cuda.Device(dev), _cupy_stream(handle, dev):
        fn(grid, block, packed)


def _memcpy_async(dst: int, src: int, nbytes: int, handle: int, dev: int) -> None:
    import cupy

    with cupy.cuda.Device(dev):
        cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, cupy.cuda.runtime.memcpyDefault, handle)


def _scratch(cache_t: torch.Tensor, shape: tuple[int, ...], scratch: Any) -> torch.Tensor:
    """A device buffer for ``mode="device"``: the caller's ``scratch`` (checked), else a new one from
    torch's caching allocator (call under the launch stream, so its reuse is ordered on it)."""
    if scratch is None:
        return torch.empty(shape, dtype=cache_t.dtype, device=cache_t.device)
    s, _ = _as_tensor(scratch, "scratch")
    nbytes = math.prod(shape) * cache_t.element_size()
    if s.device != cache_t.device or not s.is_contiguous() or s.numel() * s.element_size() < nbytes:
        raise InvalidRequest(f"scratch must be a contiguous buffer of at least {nbytes} bytes on {cache_t.device}")
    return s.reshape(-1).view(torch.uint8)[:nbytes].view(cache_t.dtype).view(shape)


def _resolve_stream(stream: Any, cache_t: torch.Tensor, cache_kind: str) -> tuple[int, torch.cuda.Stream]:
    """The launch stream as a raw handle and as a torch stream. Default: the current stream of the
    library the cache came from (torch, or CuPy for DLPack arrays)."""
    if stream is None and cache_kind != "torch":
        stream = _cupy_current()
    handle = stream_handle(stream, cache_t.device)
    return handle, _torch_stream(handle, cache_t.device)


def _torch_stream(handle: int, device: torch.device) -> torch.cuda.Stream:
    cur = torch.cuda.current_stream(device)
    if cur.cuda_stream == handle:
        return cur
    if handle == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=device)


def _ids_to_device(ids_t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Ids on ``device``, copied on the current stream without blocking the host: from pinned
    memory (torch's caching host allocator keeps the block until the copy has run)."""
    if ids_t.device == device:
        return ids_t
    if ids_t.device.type == "cpu":
        return ids_t.pin_memory().to(device, non_blocking=True)
    return ids_t.to(device)


def gather(
    cache: Any,
    block_ids: Any,
    out: Any = None,
    layer: int | None = None,
    *,
    stream: Any = None,
    mode: str | None = None,
    scratch: Any = None,
    backend: str = "auto",
) -> Any:
    """Copies blocks out of the paged cache: ``out[i] = cache[block_ids[i]]`` (or ``cache[block_ids[i],
    layer]``). ``out`` has shape ``[n, *cache.shape[1:]]`` (``[n, *cache.shape[2:]]`` for one layer)
    and the cache's dtype, or is a uint8 buffer of exactly that many bytes; it lives on the cache's
    device or, for a GPU cache, in host memory (then ``mode`` picks how it crosses, see the module
    docstring; ``scratch`` is an optional device buffer for ``mode="device"``). A new tensor is
    returned when ``out`` is None (a CuPy array when the cache is one), else ``out`` itself."""
    cache_t, cache_kind = _check_cache(cache)
    layer = _check_layer(layer, cache_t.shape[1])
    ids_t = _check_ids(block_ids, cache_t.shape[0], unique=False)
    shape = (ids_t.numel(), *_row_shape(cache_t, layer))
    out_t, host = (None, False) if out is None else _check_buffer(out, "out", cache_t, shape, writable=True)
    mode = _check_mode(mode)
    use_kernels = _use_kernels(cache_t, backend)
    mapped_ptr = None
    if host and mode == "mapped" and use_kernels:
        mapped_ptr = _mapped_pointer(out_t)
        if mapped_ptr is None:
            raise InvalidRequest("mode='mapped' needs pinned host memory for out (see engine.staging.StagingPool)")

    if cache_t.device.type == "cpu":
        if out_t is None:
            out_t = torch.empty(shape, dtype=cache_t.dtype)
        if ids_t.numel():
            view = cache_t if layer is None else cache_t[:, layer]
            torch.index_select(view, 0, ids_t.cpu(), out=out_t)
    else:
        handle, tstream = _resolve_stream(stream, cache_t, cache_kind)
        # Everything allocated here (ids on the device, out, scratch) belongs to the launch stream,
        # so the caching allocator orders its reuse after this copy.
        with torch.cuda.stream(tstream):
            ids_t = _ids_to_device(ids_t, cache_t.device)
            if out_t is None:
                out_t = torch.empty(shape, dtype=cache_t.dtype, device=cache_t.device)
            if not ids_t.numel():
                pass
            elif use_kernels:
                if host and mode == "device":
                    tmp = _scratch(cache_t, shape, scratch)
                    _launch("gather", cache_t, tmp.data_ptr(), ids_t, layer, handle)
                    _memcpy_async(out_t.data_ptr(), tmp.data_ptr(), tmp.numel() * tmp.element_size(), handle,
                                  cache_t.device.index)  # fmt: skip
                else:  # device out, or pinned host out written in place
                    _launch("gather", cache_t, mapped_ptr or out_t.data_ptr(), ids_t, layer, handle)
            else:
                view = cache_t if layer is None else cache_t[:, layer]
                if host:
                    out_t.copy_(view.index_select(0, ids_t), non_blocking=True)
                else:
                    torch.index_select(view, 0, ids_t, out=out_t)

    if out is not None:
        return out
    if cache_kind == "dlpack":
        import cupy

        return cupy.from_dlpack(out_t)
    return out_t


def scatter(
    cache: Any,
    block_ids: Any,
    src: Any,
    layer: int | None = None,
    *,
    stream: Any = None,
    mode: str | None = None,
    scratch: Any = None,
    backend: str = "auto",
) -> None:
    """Copies blocks into the paged cache: ``cache[block_ids[i]] = src[i]`` (or ``cache[block_ids[i],
    layer] = src[i]``). ``src`` is shaped, typed and placed as ``gather``'s ``out``. Block ids must be
    distinct. Nothing is written when any argument is refused."""
    cache_t, cache_kind = _check_cache(cache)
    layer = _check_layer(layer, cache_t.shape[1])
    ids_t = _check_ids(block_ids, cache_t.shape[0], unique=True)
    shape = (ids_t.numel(), *_row_shape(cache_t, layer))
    src_t, host = _check_buffer(src, "src", cache_t, shape, writable=False)
    mode = _check_mode(mode)
    use_kernels = _use_kernels(cache_t, backend)
    mapped_ptr = None
    if host and mode == "mapped" and use_kernels:
        mapped_ptr = _mapped_pointer(src_t)
        if mapped_ptr is None:
            raise InvalidRequest("mode='mapped' needs pinned host memory for src (see engine.staging.StagingPool)")
    if not ids_t.numel():
        return

    if cache_t.device.type == "cpu":
        view = cache_t if layer is None else cache_t[:, layer]
        view.index_copy_(0, ids_t.cpu().long(), src_t)
        return
    handle, tstream = _resolve_stream(stream, cache_t, cache_kind)
    with torch.cuda.stream(tstream):
        ids_t = _ids_to_device(ids_t, cache_t.device)
        if use_kernels:
            if host and mode == "device":
                tmp = _scratch(cache_t, shape, scratch)
                _memcpy_async(tmp.data_ptr(), src_t.data_ptr(), tmp.numel() * tmp.element_size(), handle,
                              cache_t.device.index)  # fmt: skip
                _launch("scatter", cache_t, tmp.data_ptr(), ids_t, layer, handle)
            else:  # device src, or pinned host src read in place
                _launch("scatter", cache_t, mapped_ptr or src_t.data_ptr(), ids_t, layer, handle)
        else:
            view = cache_t if layer is None else cache_t[:, layer]
            view.index_copy_(0, ids_t.long(), src_t.to(cache_t.device, non_blocking=True) if host else src_t)


def _cupy_current():
    import cupy

    return cupy.cuda.get_current_stream()


def gather_reference(cache: torch.Tensor, block_ids: Sequence[int], layer: int | None = None) -> torch.Tensor:
    """The plain-indexing answer ``gather`` must equal (one block at a time; for tests and benchmarks)."""
    rows = [cache[b] if layer is None else cache[b, layer] for b in block_ids]
    if not rows:
        return torch.empty((0, *_row_shape(cache, layer)), dtype=cache.dtype, device=cache.device)
    return torch.stack(rows)
