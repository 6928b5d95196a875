"""kvstore as SGLang's HiCache storage backend, against the real ``HiCacheStorage`` interface and a
real CPU ``MHATokenToKVPoolHost`` (SGLang's host memory pool), with a real store.

SGLang (0.5.23, about 11 GB with its CUDA torch) does not fit the default environment: these tests
run in the opt-in one that ``scripts/setup_sglang.sh`` makes (``.venv-sglang``), and skip elsewhere:

    bash scripts/setup_sglang.sh && .venv-sglang/bin/python -m pytest tests/integrations/test_sglang.py
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed (scripts/setup_sglang.sh)")

import torch  # noqa: E402
from conftest import flip_byte, locations, wait_until  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

from kvstore import SyncKVStoreClient  # noqa: E402
from kvstore.extent import HEADER_SIZE  # noqa: E402
from kvstore.integrations.sglang import KVStoreHiCacheStorage  # noqa: E402

PAGE = 4
LAYERS = 3


def host_pool(layout: str) -> MHATokenToKVPoolHost:
    kv = MHATokenToKVPool(
        256, PAGE, torch.float16, 2, 16, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1,
        enable_alt_stream=False,
    )  # fmt: skip
    return MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False,
        device_capacity_tokens=kv.size if kv.host_capacity_tokens is None else kv.host_capacity_tokens,
        start_layer=kv.start_layer, end_layer=kv.end_layer, write_back_staging=kv.hicache_write_back_staging,
    )  # fmt: skip


def config(meta: str, model: str = "m", tp_rank: int = 0, v1: bool = True) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=model,
        extra_config={"meta": meta, "interface_v1": int(v1), "transport": "tcp"},
    )  # fmt: skip


def fill(host: MHATokenToKVPoolHost, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.kv_buffer.dtype))


def pages(host: MHATokenToKVPoolHost, first: int, n: int) -> list[torch.Tensor]:
    return [host.get_data_page(i * PAGE, flat=True).clone() for i in range(first, first + n)]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pages_round_trip_in_place_and_the_hit_prefix_is_counted(store, layout):
    host = host_pool(layout)
    s = KVStoreHiCacheStorage(config(store.meta_addr), None, host)
    keys = [f"page-{layout}-{i}" for i in range(5)]
    fill(host, 1)
    want = pages(host, 2, 5)
    idx = torch.arange(2 * PAGE, 7 * PAGE)
    assert s.batch_exists(keys) == 0
    assert s.batch_get_v1(keys, idx) == [False] * 5  # misses, not errors
    assert s.batch_set_v1(keys[:3], idx[: 3 * PAGE]) == [True] * 3
    assert s.batch_exists(keys) == 3 and s.exists(keys[0]) and not s.exists(keys[4])
    host.kv_buffer.zero_()
    # Read into other pages of the pool: pages 10.. hold them afterwards.
    dst = torch.arange(10 * PAGE, 15 * PAGE)
    assert s.batch_get_v1(keys, dst) == [True, True, True, False, False]
    got = pages(host, 10, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want[:3]))


def test_a_corrupted_page_is_a_miss_from_there_on(store):
    host = host_pool("page_first")
    s = KVStoreHiCacheStorage(config(store.meta_addr), None, host)
    keys = [f"c{i}" for i in range(4)]
    fill(host, 2)
    want = pages(host, 0, 4)
    assert all(s.batch_set_v1(keys, torch.arange(0, 4 * PAGE)))
    parts = s._parts_per_page()
    ks = s._page_keys(keys, parts)
    loc = locations(store.meta_addr, ks)[2 * parts]  # page 2's first buffer
    flip_byte(store.shm_paths[0], loc.offset + HEADER_SIZE + 7)
    host.kv_buffer.zero_()
    assert s.batch_get_v1(keys, torch.arange(20 * PAGE, 24 * PAGE)) == [True, True, False, False]
    assert all(torch.equal(a, b) for a, b in zip(pages(host, 20, 2), want[:2]))
    with SyncKVStoreClient(store.meta_addr) as c:
        wait_until(lambda: c.lookup(ks) == 2 * parts)  # the bad replica is dropped
    assert s.batch_exists(keys) == 2


def test_whole_page_tensors_and_scopes_that_never_share(store):
    host = host_pool("layer_first")
    s = KVStoreHiCacheStorage(config(store.meta_addr, v1=False), None, host)
    fill(host, 3)
    data = pages(host, 0, 3)
    keys = ["t0", "t1", "t2"]
    assert s.batch_set(keys[:2], data[:2]) and s.set(keys[2], data[2])
    assert s.batch_exists(keys) == 3
    out = [host.get_dummy_flat_data_page() for _ in keys]
    got = s.batch_get(keys + ["absent"], out + [host.get_dummy_flat_data_page()])
    assert got[3] is None and all(torch.equal(g, d) for g, d in zip(got[:3], data))
    assert s.get("absent", host.get_dummy_flat_data_page()) is None
    # Another model or another TP rank names other blocks; the same scope in a new backend shares.
    assert KVStoreHiCacheStorage(config(store.meta_addr, model="other", v1=False), None, host).batch_exists(keys) == 0
    assert KVStoreHiCacheStorage(config(store.meta_addr, tp_rank=1, v1=False), None, host).batch_exists(keys) == 0
    assert KVStoreHiCacheStorage(config(store.meta_addr, v1=False), None, host).batch_exists(keys) == 3
    # The same pages in a pool of another layout have other bytes of the same size: other keys.
    other = host_pool("page_first")
    assert KVStoreHiCacheStorage(config(store.meta_addr, v1=False), None, other).batch_exists(keys) == 0


def test_a_store_that_is_gone_means_misses(cluster):
    cluster.start_meta()
    cluster.start_daemon()
    host = host_pool("page_first")
    cfg = config(cluster.meta_addr)
    cfg.extra_config["rpc_timeout_s"] = 1.0
    s = KVStoreHiCacheStorage(cfg, None, host)
    keys = ["g0", "g1"]
    assert all(s.batch_set_v1(keys, torch.arange(0, 2 * PAGE)))
    for p in list(cluster.procs):
        p.kill()
    assert s.batch_exists(keys) == 0
    assert s.batch_get_v1(keys, torch.arange(0, 2 * PAGE)) == [False, False]
    assert s.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [False, False]
    assert s.get_stats()["exists_failures"] >= 1


def test_sglang_loads_it_as_a_dynamic_backend(store):
    """What ``--hicache-storage-backend dynamic`` does: SGLang's factory imports the class from the
    extra config, then registers the host pool; SGLang uses the in-place interface with it."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    host = host_pool("page_first")
    cfg = config(store.meta_addr)
    cfg.extra_config.update(
        backend_name="kvstore", module_path="kvstore.integrations.sglang", class_name="KVStoreHiCacheStorage"
    )
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    backend.register_mem_pool_host(host)
    inner = getattr(backend, "_storage", backend)  # SGLang may wrap it (its failure injector)
    assert isinstance(inner, KVStoreHiCacheStorage) and inner.v1
    fill(host, 4)
    assert all(backend.batch_set_v1(["d0", "d1"], torch.arange(0, 2 * PAGE)))
    assert backend.batch_exists(["d0", "d1", "d2"]) == 2
