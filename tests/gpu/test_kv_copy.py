"""``engine.kv_copy``: gather and scatter equal plain indexing, on every target (the CPU fallback,
the CUDA kernels, the torch fallback on a GPU), for every dtype, for 0, 1 and many blocks, whole
blocks and one layer; bad arguments raise ``ValueError`` before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_env import TARGETS, need_cuda, target_params

torch = pytest.importorskip("torch", reason="torch is not installed")

from engine import kv_copy  # noqa: E402
from engine.kv_copy import gather, gather_reference, scatter  # noqa: E402

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 37, 3, 4, 2, 8
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
COUNTS = [0, 1, 23]


@pytest.fixture(params=target_params())
def target(request) -> tuple[str, str]:
    """(device, backend) of one copy target; skips the GPU ones where they cannot run."""
    name = request.param
    if name != "cpu":
        need_cuda(kernels=name == "cuda")
    return TARGETS[name]


def make_cache(device: str, dtype: torch.dtype, seed: int = 0, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    shape = shape or (NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    g = torch.Generator().manual_seed(seed)
    # random bits, not random numbers: every bit pattern must survive (NaNs and infinities too)
    bits = torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int32)
    if dtype == torch.float32:
        bits = (bits << 16) | torch.randint(0, 2**16, shape, generator=g, dtype=torch.int32)
        return bits.view(torch.float32).to(device)
    return bits.to(torch.int16).view(dtype).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN != NaN would fail an equality on values)."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- correctness ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [None, 0, NUM_LAYERS - 1], ids=["all-layers", "layer0", "last-layer"])
@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gather_equals_reference(target, dtype, n, layer):
    device, backend = target
    cache = make_cache(device, dtype, seed=n)
    ids = np.random.default_rng(n).integers(0, NUM_BLOCKS, n).tolist()  # repeats allowed
    before = cache.clone()
    out = gather(cache, ids, layer=layer, backend=backend)
    sync(device)
    assert out.device == cache.device
    assert same(out, gather_reference(cache, ids, layer))
    assert same(cache, before)  # a gather never writes the cache


@pytest.mark.parametrize("layer", [None, 1], ids=["all-layers", "layer1"])
@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_scatter_equals_reference(target, dtype, n, layer):
    device, backend = target
    cache = make_cache(device, dtype, seed=1)
    ids = np.random.default_rng(100 + n).permutation(NUM_BLOCKS)[:n].tolist()
    row = cache.shape[1:] if layer is None else cache.shape[2:]
    src = make_cache(device, dtype, seed=2, shape=(n, *row))
    expect = cache.clone()
    for i, b in enumerate(ids):
        if layer is None:
            expect[b] = src[i]
        else:
            expect[b, layer] = src[i]
    scatter(cache, ids, src, layer=layer, backend=backend)
    sync(device)
    assert same(cache, expect)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_layer_by_layer(target, dtype):
    """Save whole blocks, load them elsewhere one layer at a time: the cache holds the same KV."""
    device, backend = target
    cache = make_cache(device, dtype, seed=3)
    src_ids, dst_ids = [4, 9, 0, 31], [36, 1, 2, 17]
    saved = gather(cache, src_ids, backend=backend)
    for layer in range(NUM_LAYERS):
        scatter(cache, dst_ids, saved[:, layer].contiguous(), layer=layer, backend=backend)
    sync(device)
    assert same(gather_reference(cache, dst_ids), gather_reference(cache, src_ids))


def test_block_id_forms(target):
    device, backend = target
    cache = make_cache(device, torch.bfloat16, seed=4)
    ids = [5, 0, 36, 5, 12]
    expect = gather_reference(cache, ids)
    forms = [
        ids,
        tuple(ids),
        np.array(ids, dtype=np.int32),
        np.array(ids, dtype=np.int64),
        np.array(ids, dtype=np.uint16),
        torch.tensor(ids, dtype=torch.int32),
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(ids, dtype=torch.int32, device=device),
        torch.tensor(ids, dtype=torch.int64, device=device),
    ]
    for form in forms:
        assert same(gather(cache, form, backend=backend), expect), type(form)
    assert same(gather(cache, range(3, 7), backend=backend), gather_reference(cache, list(range(3, 7))))


def test_out_buffers(target):
    """``out`` is written in place and returned; a uint8 buffer of the right size (a raw staging
    slab) is viewed as the cache's dtype."""
    device, backend = target
    cache = make_cache(device, torch.float16, seed=5)
    ids = [3, 1, 4, 1, 5]
    expect = gather_reference(cache, ids, 2)
    out = torch.empty_like(expect)
    assert gather(cache, ids, out=out, layer=2, backend=backend) is out
    raw = torch.empty(expect.numel() * 2, dtype=torch.uint8, device=device)
    assert gather(cache, ids, out=raw, layer=2, backend=backend) is raw
    sync(device)
    assert same(out, expect)
    assert same(raw.view(torch.float16).view(expect.shape), expect)
    if device == "cpu":
        arr = np.empty(expect.numel() * 2, dtype=np.uint8)
        assert gather(cache, ids, out=arr, layer=2) is arr
        assert same(torch.from_numpy(arr).view(torch.float16).view(expect.shape), expect)
        scatter(cache, [0, 2, 6, 7, 8], arr, layer=0)  # numpy src
        assert same(gather_reference(cache, [0, 2, 6, 7, 8], 0), expect)


def test_unaligned_rows_and_buffers(target):
    """Rows that are not a multiple of 16 bytes, and buffers whose alignment differs from the
    cache's: the scalar head/tail and the element-wise fallback."""
    device, backend = target
    cache = make_cache(device, torch.float16, seed=6, shape=(11, 2, 2, 1, 1, 3))  # 24-byte blocks, 12-byte layers
    ids = [10, 0, 7, 3, 3]
    for layer in (None, 1):
        expect = gather_reference(cache, ids, layer)
        nbytes = expect.numel() * 2
        for shift in (0, 2, 6, 8, 14):
            backing = torch.zeros(nbytes + 16, dtype=torch.uint8, device=device)
            out = backing[shift : shift + nbytes]
            gather(cache, ids, out=out, layer=layer, backend=backend)
            sync(device)
            assert same(out.view(torch.float16).view(expect.shape), expect), (layer, shift)
            assert int(backing[:shift].count_nonzero()) == 0 and int(backing[shift + nbytes :].count_nonzero()) == 0
            fresh = make_cache(device, torch.float16, seed=7, shape=tuple(cache.shape))
            scatter(fresh, [1, 2, 4, 5, 6], out, layer=layer, backend=backend)
            sync(device)
            assert same(gather_reference(fresh, [1, 2, 4, 5, 6], layer), expect)


def test_more_rows_than_one_grid_dimension(target):
    """More blocks than gridDim.y may hold (65535): the kernels' row loop covers the rest."""
    device, backend = target
    n = kv_copy.MAX_GRID_Y + 4466
    cache = make_cache(device, torch.float16, seed=8, shape=(n, 1, 2, 1, 1, 8))
    ids = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    out = gather(cache, ids, backend=backend)
    sync(device)
    assert same(out, cache.cpu()[ids])
    back = torch.zeros_like(cache)
    scatter(back, ids, out, backend=backend)
    sync(device)
    assert same(back, cache)


# -- bad arguments: ValueError, nothing written ---------------------------------------------------


def _refused(fn, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def test_out_of_range_ids_are_refused(target):
    device, backend = target
    cache = make_cache(device, torch.bfloat16, seed=9)
    before = cache.clone()
    src = torch.zeros((2, *cache.shape[1:]), dtype=cache.dtype, device=device)
    for ids in ([0, NUM_BLOCKS], [-1, 0], [NUM_BLOCKS + 1000, 1]):
        bad = next(b for b in ids if not 0 <= b < NUM_BLOCKS)
        msg = rf"block id {bad} \(position {ids.index(bad)}\) is outside \[0, {NUM_BLOCKS}\)"
        for form in (ids, np.array(ids), torch.tensor(ids), torch.tensor(ids, device=device)):
            _refused(lambda form=form: gather(cache, form, backend=backend), msg)
            _refused(lambda form=form: scatter(cache, form, src, backend=backend), msg)
            _refused(lambda form=form: scatter(cache, form, src[:, 0].contiguous(), layer=0, backend=backend), msg)
    _refused(lambda: gather(cache, np.array([2**40], dtype=np.uint64), backend=backend), "outside")
    _refused(lambda: gather(cache, [2**70], backend=backend), "outside")
    sync(device)
    assert same(cache, before)


def test_bad_arguments_are_refused(target):
    device, backend = target
    cache = make_cache(device, torch.float32, seed=10)
    before = cache.clone()
    ids = [1, 2]
    src = torch.zeros((2, *cache.shape[1:]), dtype=cache.dtype, device=device)
    layer_src = torch.zeros((2, *cache.shape[2:]), dtype=cache.dtype, device=device)
    cases = {
        "layer": [
            (lambda: gather(cache, ids, layer=NUM_LAYERS, backend=backend), rf"layer {NUM_LAYERS} is outside"),
            (lambda: gather(cache, ids, layer=-1, backend=backend), "layer -1 is outside"),
            (lambda: scatter(cache, ids, layer_src, layer=True, backend=backend), "layer must be an int"),
            (lambda: gather(cache, ids, layer=1.0, backend=backend), "layer must be an int"),
        ],
        "ids": [
            (lambda: gather(cache, [1.0], backend=backend), "must be ints"),
            (lambda: gather(cache, [True], backend=backend), "must be ints"),
            (lambda: gather(cache, torch.tensor([1.0], device=device), backend=backend), "must be integers"),
            (lambda: gather(cache, np.array([True]), backend=backend), "must be integers"),
            (lambda: gather(cache, torch.tensor([[1, 2]], device=device), backend=backend), "must be 1-D"),
            (lambda: gather(cache, np.array([[1, 2]]), backend=backend), "must be 1-D"),
            (lambda: gather(cache, 3, backend=backend), "sequence of ints"),
            (lambda: gather(cache, "12", backend=backend), "sequence of ints"),
            (lambda: scatter(cache, [4, 4], src, backend=backend), "block id 4 appears more than once"),
            (
                lambda: scatter(
                    cache, torch.tensor([3, 9, 3], device=device), src.repeat(2, 1, 1, 1, 1, 1)[:3], backend=backend
                ),
                "block id 3 appears more than once",
            ),  # fmt: skip
        ],
        "buffers": [
            (lambda: gather(cache, ids, out=torch.empty_like(src[:1]), backend=backend), "out shape must be"),
            (lambda: gather(cache, ids, out=torch.empty_like(src), layer=0, backend=backend), "out shape must be"),
            (lambda: gather(cache, ids, out=src.half(), backend=backend), "out dtype must match"),
            (lambda: scatter(cache, ids, src.double(), backend=backend), "src dtype must match"),
            (lambda: scatter(cache, ids, layer_src, backend=backend), "src shape must be"),
            (
                lambda: scatter(cache, ids, src.transpose(0, 1).contiguous().transpose(0, 1), backend=backend),
                "src must be contiguous",
            ),  # fmt: skip
            (
                lambda: gather(cache, ids, out=torch.empty(7, dtype=torch.uint8, device=device), backend=backend),
                "holds 7 bytes",
            ),  # fmt: skip
            (lambda: scatter(cache, ids, [[0.0]], backend=backend), "must be a torch tensor"),
        ],
        "cache": [
            (lambda: gather(cache.double(), ids, backend=backend), "cache dtype must be one of"),
            (lambda: gather(cache.view(torch.int32), ids, backend=backend), "cache dtype must be one of"),
            (lambda: gather(cache.transpose(1, 2), ids, backend=backend), "cache must be contiguous"),
            (lambda: gather(cache[:, 0, 0, 0, 0, 0].contiguous(), ids, backend=backend), r"cache must be \[num_blocks"),
            (lambda: gather(cache[:0], [], backend=backend), "cache is empty"),
        ],
        "options": [
            (lambda: gather(cache, ids, backend="fast"), "backend must be one of"),
            (lambda: gather(cache, ids, mode="zero-copy", backend=backend), "mode must be one of"),
        ],
    }
    for group, items in cases.items():
        for fn, match in items:
            try:
                _refused(fn, match)
            except BaseException as e:
                raise AssertionError(f"{group}: expected ValueError matching {match!r}") from e
    sync(device)
    assert same(cache, before)


def test_cuda_backend_on_a_cpu_cache_is_refused():
    cache = make_cache("cpu", torch.float32)
    _refused(lambda: gather(cache, [0], backend="cuda"), "backend='cuda' needs a cache on a CUDA GPU")


@pytest.mark.gpu
def test_buffers_on_another_device_are_refused():
    need_cuda()
    cache = make_cache("cpu", torch.float32)
    out = torch.empty((1, *cache.shape[1:]), device="cuda")
    _refused(lambda: gather(cache, [0], out=out), "out is on cuda")
    _refused(lambda: scatter(cache, [0], out), "src is on cuda")
    gpu_cache = cache.cuda()
    _refused(lambda: gather(gpu_cache, [0], stream="s"), "stream must be")


# -- GPU only: streams, CuPy arrays, host staging ------------------------------------------------


@pytest.mark.gpu
def test_module_is_compiled_once_per_device():
    need_cuda(kernels=True)
    a = kv_copy.load_module(0)
    assert kv_copy.load_module(0) is a
    for name in kv_copy.KERNEL_NAMES:
        assert a.get_function(name) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_side_streams(backend):
    need_cuda(kernels=backend == "cuda")
    import cupy

    cache = make_cache("cuda", torch.bfloat16, seed=11)
    ids = [8, 2, 30]
    expect = gather_reference(cache, ids)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    out = gather(cache, ids, stream=side, backend=backend)
    side.synchronize()
    assert same(out, expect)
    cs = cupy.cuda.Stream(non_blocking=True)
    torch.cuda.synchronize()
    scatter(cache, [0, 1, 3], out, stream=cs, backend=backend)
    cs.synchronize()
    assert same(gather_reference(cache, [0, 1, 3]), expect)
    out2 = gather(cache, ids, layer=1, stream=side.cuda_stream, backend=backend)  # a raw handle
    side.synchronize()
    assert same(out2, gather_reference(cache, ids, 1))


@pytest.mark.gpu
def test_cupy_arrays_through_dlpack():
    need_cuda(kernels=True)
    import cupy

    cache_t = make_cache("cuda", torch.float16, seed=12)
    cache = cupy.from_dlpack(cache_t)  # the same memory
    ids = cupy.asarray([4, 20, 4], dtype=cupy.int32)
    out = gather(cache, ids, layer=2)
    assert isinstance(out, cupy.ndarray)
    cupy.cuda.get_current_stream().synchronize()
    assert same(torch.from_dlpack(out), gather_reference(cache_t, [4, 20, 4], 2))
    scatter(cache, cupy.asarray([0, 1, 2]), out, layer=0)
    cupy.cuda.get_current_stream().synchronize()
    assert same(gather_reference(cache_t, [0, 1, 2], 0), gather_reference(cache_t, [4, 20, 4], 2))


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [None, 2])
@pytest.mark.parametrize("mode", kv_copy.STAGING_MODES)
@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_host_staging(backend, mode, layer):
    """GPU cache <-> pinned host slab, in both staging modes, on the pool's own stream."""
    need_cuda(kernels=backend == "cuda")
    if backend == "torch" and mode == "mapped":
        pytest.skip("the torch fallback has no mapped mode (it always copies through the device)")
    from engine.staging import StagingPool

    cache = make_cache("cuda", torch.bfloat16, seed=13)
    ids = [7, 3, 35, 0]
    expect = gather_reference(cache, ids, layer)
    with StagingPool(expect.numel() * 2, 2) as pool:
        assert pool.pinned
        with pool.acquire() as slab:
            host = slab.torch(torch.bfloat16, tuple(expect.shape))
            assert host.is_pinned()
            torch.cuda.synchronize()
            assert gather(cache, ids, out=host, layer=layer, stream=pool.stream, mode=mode, backend=backend) is host
            pool.synchronize()
            assert same(host, expect)
            raw = slab.numpy(np.uint8, expect.numel() * 2)  # what the store client would put
            assert raw.tobytes() == bits(expect).numpy().tobytes()
            dst = [1, 2, 4, 5]
            scatter(cache, dst, raw, layer=layer, stream=pool.stream, mode=mode, backend=backend)
            pool.synchronize()
            assert same(gather_reference(cache, dst, layer), expect)


@pytest.mark.gpu
def test_mapped_mode_needs_pinned_memory():
    need_cuda(kernels=True)
    cache = make_cache("cuda", torch.float32, seed=14)
    out = torch.empty((1, *cache.shape[1:]))  # pageable
    _refused(lambda: gather(cache, [0], out=out, mode="mapped"), "needs pinned host memory")
    _refused(lambda: scatter(cache, [0], out, mode="mapped"), "needs pinned host memory")
    gather(cache, [0], out=out, mode="device")  # pageable memory is fine through the device
    torch.cuda.synchronize()
    assert same(out, gather_reference(cache, [0]))


@pytest.mark.gpu
def test_realistic_block_shape():
    """Llama-3-8B's KV block: 32 layers x 2 x 16 tokens x 8 heads x 128 dims of bf16 = 2 MiB."""
    need_cuda(kernels=True)
    cache = make_cache("cuda", torch.bfloat16, seed=15, shape=(48, 32, 2, 16, 8, 128))
    ids = torch.randperm(48, generator=torch.Generator().manual_seed(1))[:20].tolist()
    out = gather(cache, ids)
    per_layer = gather(cache, ids, layer=31)
    torch.cuda.synchronize()
    assert same(out, gather_reference(cache, ids))
    assert same(per_layer, gather_reference(cache, ids, 31))
    fresh = torch.zeros_like(cache)
    scatter(fresh, ids, out)
    torch.cuda.synchronize()
    assert same(gather_reference(fresh, ids), out)
