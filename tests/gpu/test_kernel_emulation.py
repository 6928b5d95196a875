"""The CUDA kernels' own arithmetic, checked on the CPU: ``cuda/kv_copy.cu`` built for the host
(``kv_copy_host.cpp`` beside this file runs a launch's threads one after another), launched with
exactly the kernel name, grid and arguments that ``engine.kv_copy`` computes, and compared with
plain indexing. On a GPU the same source runs for real (``test_kv_copy.py``'s cuda variants)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from engine import kv_copy  # noqa: E402
from engine.kv_copy import gather_reference, launch_plan  # noqa: E402

HERE = Path(__file__).resolve().parent
CXX = shutil.which("g++") or shutil.which("clang++")


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory) -> ctypes.CDLL:
    if CXX is None:
        pytest.skip("no host C++ compiler (g++ or clang++) to build the kernels for the CPU")
    lib = tmp_path_factory.mktemp("kv_copy_host") / "kv_copy_host.so"
    cmd = [CXX, "-std=c++17", "-O1", "-Wall", "-Wno-unknown-pragmas", "-Werror", "-shared", "-fPIC",
           "-o", str(lib), str(HERE / "kv_copy_host.cpp")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"host build of cuda/kv_copy.cu failed:\n{r.stderr}"
    dll = ctypes.CDLL(str(lib))
    dll.kv_emulate.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                               ctypes.POINTER(ctypes.c_longlong)]  # fmt: skip
    dll.kv_emulate.restype = ctypes.c_int
    return dll


def run(dll: ctypes.CDLL, plan, grid: tuple[int, int] | None = None) -> None:
    name, (gx, gy, _), (bx, _, _), args = plan
    if grid is not None:
        gx, gy = grid
    fn = ctypes.cast(getattr(dll, name), ctypes.c_void_p).value
    packed = (ctypes.c_longlong * len(args))(*[ctypes.c_longlong(a).value for a in args])
    assert dll.kv_emulate(fn, len(args), gx, gy, bx, packed) == 0


def make_cache(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
                        generator=g, dtype=torch.uint8)  # fmt: skip
    return raw.view(dtype).view(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


SHAPE = (29, 3, 2, 4, 2, 8)  # 768-byte blocks, 256-byte layers


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("layer", [None, 0, 2], ids=["all-layers", "layer0", "layer2"])
def test_host_kernels_equal_reference(host_kernels, dtype, index_dtype, layer):
    cache = make_cache(dtype, SHAPE, seed=1)
    ids = torch.tensor([28, 0, 5, 5, 17, 3, 11], dtype=index_dtype)
    expect = gather_reference(cache, ids.tolist(), layer)
    out = torch.zeros_like(expect)
    plan = launch_plan("gather", cache, out.data_ptr(), ids, layer)
    assert plan[0] == kv_copy.kernel_name("gather", "blocks" if layer is None else "layer", dtype, index_dtype)
    run(host_kernels, plan)
    assert raw_bytes(out) == raw_bytes(expect)

    fresh = make_cache(dtype, SHAPE, seed=2)
    expect_cache = fresh.clone()
    dst = torch.tensor([1, 2, 4, 8, 16, 27, 26], dtype=index_dtype)
    for i, b in enumerate(dst.tolist()):
        if layer is None:
            expect_cache[b] = out[i]
        else:
            expect_cache[b, layer] = out[i]
    run(host_kernels, launch_plan("scatter", fresh, out.data_ptr(), dst, layer))
    assert raw_bytes(fresh) == raw_bytes(expect_cache)


@pytest.mark.parametrize("grid", [(1, 1), (1, 3), (2, 1), (3, 2)])
def test_any_grid_is_correct(host_kernels, grid):
    """Both grid dimensions are grid-stride loops: a grid smaller than one CTA per chunk and row
    (as when rows exceed gridDim.y's limit) still copies everything."""
    cache = make_cache(torch.bfloat16, (40, 4, 2, 16, 2, 64), seed=3)  # 32 KiB blocks: 2 chunks each
    ids = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:9]
    for layer in (None, 3):
        expect = gather_reference(cache, ids.tolist(), layer)
        out = torch.zeros_like(expect)
        run(host_kernels, launch_plan("gather", cache, out.data_ptr(), ids, layer), grid=grid)
        assert raw_bytes(out) == raw_bytes(expect), (grid, layer)


@pytest.mark.parametrize("shift", [0, 2, 4, 6, 8, 10, 14])
def test_unaligned_rows_and_buffers(host_kernels, shift):
    """12- and 24-byte rows (not multiples of 16) and a staging buffer misaligned by ``shift``: the
    scalar head and tail, and the element-wise path when the two sides' alignments differ."""
    cache = make_cache(torch.float16, (13, 2, 2, 1, 1, 3), seed=4)
    ids = torch.tensor([12, 0, 7, 3, 3, 9], dtype=torch.int64)
    for layer in (None, 1):
        expect = gather_reference(cache, ids.tolist(), layer)
        nbytes = expect.numel() * 2
        backing = torch.zeros(nbytes + 32, dtype=torch.uint8)
        out = backing[shift : shift + nbytes]
        run(host_kernels, launch_plan("gather", cache, out.data_ptr(), ids, layer))
        assert out.numpy().tobytes() == raw_bytes(expect)
        assert not backing[:shift].any() and not backing[shift + nbytes :].any()  # nothing written outside

        fresh = torch.zeros_like(cache)
        dst = torch.tensor([0, 1, 2, 4, 5, 6])
        run(host_kernels, launch_plan("scatter", fresh, out.data_ptr(), dst, layer))
        assert raw_bytes(gather_reference(fresh, dst.tolist(), layer)) == raw_bytes(expect)
        others = [b for b in range(13) if b not in dst.tolist()]
        assert not fresh[others].view(torch.uint8).any()


def test_realistic_block(host_kernels):
    """A 2 MiB block (32 layers x 2 x 16 tokens x 8 heads x 128 dims, bf16): 128 chunks per row."""
    cache = make_cache(torch.bfloat16, (3, 32, 2, 16, 8, 128), seed=5)
    ids = torch.tensor([2, 0], dtype=torch.int32)
    out = torch.zeros((2, *cache.shape[1:]), dtype=cache.dtype)
    plan = launch_plan("gather", cache, out.data_ptr(), ids, None)
    assert plan[1][:2] == (2 * 1024 * 1024 // kv_copy.CHUNK_BYTES, 2)
    run(host_kernels, plan)
    assert raw_bytes(out) == raw_bytes(cache[[2, 0]])


def test_kernels_skip_ids_out_of_range(host_kernels):
    """Defence in depth: an id outside [0, num_blocks) that got past the host's checks is skipped,
    never followed (its staging row stays as it was, nothing else is written)."""
    cache = make_cache(torch.float32, SHAPE, seed=6)
    before = cache.clone()
    ids = torch.tensor([1, -1, 29, 2**40, 4], dtype=torch.int64)
    out = torch.full((5, *SHAPE[1:]), 7.0)
    run(host_kernels, launch_plan("gather", cache, out.data_ptr(), ids, None))
    assert raw_bytes(out[0]) == raw_bytes(cache[1]) and raw_bytes(out[4]) == raw_bytes(cache[4])
    assert bool((out[1:4] == 7.0).all())
    run(host_kernels, launch_plan("scatter", cache, out.data_ptr(), ids, 2))
    changed = (cache.view(torch.int32) != before.view(torch.int32)).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {1, 4}
