"""Round trips through real processes: put, lookup, get_into over shared memory and TCP."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import KeySpace, KVStoreClient, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig

KS = KeySpace(ModelFingerprint("test-model", "bf16", 4, 2, 64))


def blocks(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def keys_for(n: int, start: int = 0) -> list[bytes]:
    return KS.block_keys(np.arange(start, start + n * 16))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("size", [1, 4096, 65536 + 17, 2 << 20])
def test_put_get_roundtrip_bytes_identical(store, transport, size):
    keys = keys_for(6, start=size)
    data = blocks(6, size, seed=size)
    with SyncKVStoreClient(store.meta_addr, ClientConfig(transport=transport)) as c:
        assert c.lookup(keys) == 0
        res = c.put(keys, data)
        assert (res.stored, res.skipped, res.rejected) == (6, 0, 0)
        assert c.lookup(keys) == 6
        out = [np.zeros(size, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == 6
        for a, b in zip(out, data):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("writer,reader", [("shm", "tcp"), ("tcp", "shm")])
def test_written_one_way_read_the_other(store, writer, reader):
    keys = keys_for(5, start=7)
    data = blocks(5, 12345, seed=3)
    with SyncKVStoreClient(store.meta_addr, ClientConfig(transport=writer)) as w:
        assert w.put(keys, data).stored == 5
    with SyncKVStoreClient(store.meta_addr, ClientConfig(transport=reader)) as r:
        out = [np.zeros(12345, np.uint8) for _ in keys]
        assert r.get_into(keys, out) == 5
        assert all(np.array_equal(a, b) for a, b in zip(out, data))


def test_leading_run_and_partial_prefix(store):
    keys = keys_for(8)
    data = blocks(8, 1000)
    with SyncKVStoreClient(store.meta_addr) as c:
        c.put(keys[:5], data[:5])
        assert c.lookup(keys) == 5
        assert c.exists(keys) == [True] * 5 + [False] * 3
        out = [np.zeros(1000, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == 5
        assert all(np.array_equal(out[i], data[i]) for i in range(5))
        # A hole ends the run: the blocks after it are not loaded even though they exist.
        assert c.remove([keys[2]]) == 1
        assert c.lookup(keys) == 2
        assert c.exists(keys[:5]) == [True, True, False, True, True]
        assert c.get_into(keys, out) == 2


def test_dedup_skips_stored_and_counts(store):
    keys = keys_for(4)
    data = blocks(4, 2048)
    with SyncKVStoreClient(store.meta_addr) as c:
        assert c.put(keys[:2], data[:2]).stored == 2
        res = c.put(keys, data)
        assert (res.stored, res.skipped) == (2, 2)
        assert c.put(keys, data).skipped == 4
        s = c.stats()
        assert s.keys == 4
        assert s.counters["dedup_keys"] == 6
        assert s.segments[0].blocks == 4


def test_buffer_types_numpy_bytes_bytearray_torch(store):
    torch = pytest.importorskip("torch")
    keys = keys_for(3, start=99)
    t = torch.randn(4, 256, dtype=torch.bfloat16)
    f = np.random.default_rng(1).standard_normal(512).astype(np.float16)
    b = bytes(range(256)) * 4
    with SyncKVStoreClient(store.meta_addr) as c:
        assert c.put(keys, [t, f, b]).stored == 3
        t2 = torch.empty_like(t)
        f2 = np.empty_like(f)
        b2 = bytearray(len(b))
        assert c.get_into(keys, [t2, f2, b2]) == 3
        assert torch.equal(t, t2)
        assert np.array_equal(f, f2)
        assert bytes(b2) == b


async def test_async_client_concurrent_calls(store):
    async with KVStoreClient(store.meta_addr) as c:
        import asyncio

        chains = [keys_for(4, start=1000 * i) for i in range(8)]
        datas = [blocks(4, 3000, seed=i) for i in range(8)]
        results = await asyncio.gather(*(c.put(k, d) for k, d in zip(chains, datas)))
        assert sum(r.stored for r in results) == 32
        outs = [[np.zeros(3000, np.uint8) for _ in range(4)] for _ in range(8)]
        got = await asyncio.gather(*(c.get_into(k, o) for k, o in zip(chains, outs)))
        assert got == [4] * 8
        for o, d in zip(outs, datas):
            assert all(np.array_equal(a, b) for a, b in zip(o, d))


def test_pin_and_unpin(store):
    keys = keys_for(3)
    with SyncKVStoreClient(store.meta_addr) as c:
        c.put(keys, blocks(3, 100))
        assert c.pin(keys) == 3
        assert c.pin(keys) == 0  # already pinned
        assert c.stats().segments[0].pinned_blocks == 3
        assert c.unpin(keys[:1]) == 1
        assert c.stats().segments[0].pinned_blocks == 2
