"""``engine.staging.StagingPool``: one region, touched once, cut into fixed slabs that are reused
(the same addresses) across acquire and release; numpy and torch views share the slab's memory;
pinned memory and its copy stream on a GPU, page-aligned ``mmap`` memory elsewhere."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from gpu_env import CUDA_OK, need_cuda

torch = pytest.importorskip("torch", reason="torch is not installed")

from engine import kv_copy  # noqa: E402
from engine.staging import PAGE, StagingPool  # noqa: E402


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.gpu)], ids=["mmap", "pinned"])
def pool(request):
    if request.param:
        need_cuda(kernels=True)
    p = StagingPool(10_000, 4, pinned=request.param)
    yield p
    p.close()


def test_slabs_are_reused_not_reallocated(pool: StagingPool):
    base = pool.base_address
    first = pool.acquire()
    addr = first.address
    first.release()
    again = pool.acquire()
    assert again is first and again.address == addr  # the slab released last is handed out first
    again.release()
    held = [pool.acquire() for _ in range(pool.num_slabs)]
    addresses = sorted(s.address for s in held)
    assert addresses == [base + i * pool.slab_bytes for i in range(pool.num_slabs)]
    for s in held:
        s.release()
    for _ in range(3):  # many requests: always the same memory, never a new allocation
        held = [pool.acquire() for _ in range(pool.num_slabs)]
        assert sorted(s.address for s in held) == addresses
        for s in held:
            s.release()
    assert pool.base_address == base and pool.free_slabs == pool.num_slabs


def test_sizes_and_alignment(pool: StagingPool):
    assert pool.slab_bytes == -(-10_000 // PAGE) * PAGE
    assert pool.slab_bytes >= 10_000 and pool.nbytes == pool.num_slabs * pool.slab_bytes
    assert pool.base_address % PAGE == 0
    with pool.acquire() as s:
        assert s.nbytes == pool.slab_bytes and s.address % PAGE == 0
        assert s.numpy().nbytes == s.nbytes and s.memoryview.nbytes == s.nbytes
    big = StagingPool(100, 2, alignment=1 << 16, pinned=pool.pinned)
    try:
        assert big.slab_bytes == 1 << 16
        assert all(big.acquire().address % (1 << 16) == 0 for _ in range(2))
    finally:
        big.close()


def test_numpy_and_torch_views_share_memory(pool: StagingPool):
    with pool.acquire() as s:
        raw = s.numpy()
        t8 = s.torch()
        assert raw.ctypes.data == s.address == t8.data_ptr()
        assert np.shares_memory(raw, t8.numpy())
        bf = s.torch(torch.bfloat16, (4, 8))
        u16 = s.numpy(np.uint16, (4, 8))
        assert bf.data_ptr() == u16.ctypes.data == s.address
        bf[2, 3] = 1.5
        assert u16[2, 3] == 0x3FC0  # bfloat16 1.5
        u16[0, 0] = 0x4040  # bfloat16 3.0
        assert float(bf[0, 0]) == 3.0
        f32 = s.torch(torch.float32, 10)
        assert f32.shape == (10,) and f32.data_ptr() == s.address
        assert s.torch(torch.float16).numel() == s.nbytes // 2
        if pool.pinned:
            assert bf.is_pinned() and t8.is_pinned()
        with pytest.raises(ValueError, match="needs"):
            s.numpy(np.float32, (s.nbytes,))
        with pytest.raises(ValueError, match="needs"):
            s.torch(torch.float32, (s.nbytes,))


def test_misuse_is_refused(pool: StagingPool):
    s = pool.acquire()
    s.release()
    with pytest.raises(ValueError, match="released twice"):
        s.release()
    with pytest.raises(ValueError, match="not held"):
        s.numpy()
    other = StagingPool(100, 1, pinned=False)
    try:
        with pytest.raises(ValueError, match="does not belong"):
            pool.release(other.acquire())
    finally:
        other.close()
    for bad in ((0, 1), (1, 0), (-5, 2), (1, 1.5)):
        with pytest.raises(ValueError, match="must be a positive int"):
            StagingPool(*bad, pinned=False)
    with pytest.raises(ValueError, match="power of two"):
        StagingPool(100, 1, alignment=3000, pinned=False)


def test_acquire_waits_for_a_release(pool: StagingPool):
    held = [pool.acquire() for _ in range(pool.num_slabs)]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no free staging slab"):
        pool.acquire(timeout=0.05)
    assert time.monotonic() - t0 >= 0.04
    threading.Timer(0.05, held[1].release).start()
    got = pool.acquire(timeout=10)
    assert got is held[1]
    for s in held:
        s.release()


def test_close_wakes_waiters():
    pool = StagingPool(100, 1, pinned=False)
    pool.acquire()
    errors: list[BaseException] = []

    def wait():
        try:
            pool.acquire(timeout=10)
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.05)
    pool.close()
    th.join(5)
    assert not th.is_alive() and isinstance(errors[0], ValueError)
    with pytest.raises(ValueError, match="closed"):
        pool.acquire()


def test_host_only_pool_without_a_gpu():
    pool = StagingPool(4096, 2, pinned=False)
    assert not pool.pinned and pool.stream is None and pool.torch_stream is None
    with pool.acquire() as s:
        src = torch.arange(64, dtype=torch.float32)
        assert pool.copy_to_host(s, src) is None
        assert np.array_equal(s.numpy(np.float32, 64), src.numpy())
        dst = torch.zeros(64)
        assert pool.copy_to_device(s, dst, nbytes=128) is None  # CPU tensors: a plain copy
        assert torch.equal(dst[:32], src[:32]) and not dst[32:].any()
        with pytest.raises(ValueError, match="do not fit"):
            pool.copy_to_host(s, torch.zeros(2 * pool.slab_bytes, dtype=torch.uint8))
    if not CUDA_OK:
        with pytest.raises(RuntimeError, match="pinned staging needs a GPU"):
            StagingPool(4096, 1, pinned=True)
        assert not StagingPool(4096, 1).pinned  # the default falls back to mmap


def test_gather_into_a_slab_on_the_cpu():
    """The save path end to end on a CPU: cache -> slab (torch view) -> bytes for the store (numpy view)."""
    cache = torch.randn(16, 2, 2, 4, 2, 8).to(torch.bfloat16)
    block_nbytes = cache[0].numel() * 2
    ids = [3, 9, 0]
    with StagingPool(len(ids) * block_nbytes, 2, pinned=False) as pool, pool.acquire() as slab:
        kv_copy.gather(cache, ids, out=slab.torch(torch.bfloat16, (3, *cache.shape[1:])))
        blocks = slab.numpy(np.uint8, (3, block_nbytes))
        for i, b in enumerate(ids):
            assert blocks[i].tobytes() == cache[b].view(torch.uint8).numpy().tobytes()
        fresh = torch.zeros_like(cache)
        kv_copy.scatter(fresh, [1, 2, 4], blocks.reshape(-1))  # raw bytes back into the cache
        assert torch.equal(fresh[[1, 2, 4]], cache[ids])


@pytest.mark.gpu
def test_pinned_pool_copies_on_its_own_stream():
    need_cuda(kernels=True)
    with StagingPool(1 << 20, 2) as pool:
        assert pool.pinned and pool.stream is not None
        assert pool.torch_stream.cuda_stream == pool.stream.ptr
        src = torch.randn(1 << 18, device="cuda")  # 1 MiB
        with pool.acquire() as slab:
            ev = pool.copy_to_host(slab, src)  # waits for the current stream, which wrote src
            ev.synchronize()
            assert torch.equal(slab.torch(torch.float32, src.numel()), src.cpu())
            dst = torch.zeros_like(src)
            pool.copy_to_device(slab, dst).synchronize()
            assert torch.equal(dst, src)


@pytest.mark.gpu
def test_release_after_stream_work_delays_reuse():
    """A slab released with ``stream=`` is not handed out until that stream's copies have run."""
    need_cuda(kernels=True)
    with StagingPool(64 << 20, 1) as pool:
        src = torch.full((16 << 20,), 3.0, device="cuda")  # 64 MiB: a copy that takes a while
        slab = pool.acquire()
        slab.numpy(np.float32)[:] = 0
        pool.copy_to_host(slab, src)
        slab.release(stream=pool.stream)
        again = pool.acquire()  # synchronises on the event recorded at release
        assert again is slab
        assert bool((again.numpy(np.float32) == 3.0).all())
        again.release()
