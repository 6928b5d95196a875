"""Reads from known locations, without the metadata service (kvstore.client.locations), with
real processes: they are served without a lease, they never return another block's bytes when
they race eviction and reuse, a stale location falls back to the leased path, and warm caches
survive daemon and metadata restarts."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import wait_until

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.errors import Unavailable

KS = KeySpace(ModelFingerprint("direct-model", "bf16", 2, 2, 64))
SIZE = 64 << 10


def chain(n: int, start: int = 0) -> list[bytes]:
    return KS.block_keys(np.arange(start, start + 16 * n))


def payload(key: bytes, size: int = SIZE) -> np.ndarray:
    """A block's bytes, derived from its key: any other block's bytes are told apart."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, size, dtype=np.uint8)


def stored(c: SyncKVStoreClient, keys: list[bytes]) -> int:
    """The leading hit count, or -1 while the service cannot be reached (it is restarting)."""
    try:
        return c.lookup(keys)
    except Unavailable:
        return -1


def read(c: SyncKVStoreClient, keys: list[bytes]) -> tuple[int, list[np.ndarray]]:
    out = [np.zeros(SIZE, np.uint8) for _ in keys]
    return c.get_into(keys, out), out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_known_blocks_are_read_without_the_service(store, transport):
    keys = chain(8)
    store.wait_served()
    with SyncKVStoreClient(store.meta_addr, ClientConfig(transport=transport)) as c:
        assert c.put(keys, [payload(k) for k in keys]).stored == 8
        n, _ = read(c, keys)  # over TCP a put's write tickets do not read: this one takes a lease
        assert n == 8
        acquires = c.stats().counters["acquires"]
        for _ in range(5):
            n, out = read(c, keys)
            assert n == 8 and all(np.array_equal(o, payload(k)) for o, k in zip(out, keys))
        assert c.stats().counters["acquires"] == acquires  # no Acquire: served from known locations
        assert c.location_stats()["hits"] >= 40
        # The service still sees those reads (batched Touch), for its cache policy.
        wait_until(lambda: c.stats().counters["touched_keys"] >= 40)
        # Keys after the known run are read through a lease, in the same call.
        more = keys + chain(2, start=16 * 8)
        c.put(more[8:], [payload(k) for k in more[8:]])
        with SyncKVStoreClient(store.meta_addr, ClientConfig(transport=transport, location_cache=0)) as cold:
            n, out = read(cold, more)
            assert n == 10 and all(np.array_equal(o, payload(k)) for o, k in zip(out, more))
            assert cold.location_stats() == {"hits": 0, "stale": 0, "known": 0}


def test_a_writer_reads_what_it_put_through_shared_memory_without_the_service(store):
    """A put's placements are remembered with the checksums the blocks were sealed with, so the
    first read of them after the put needs no Acquire and finds no stale location."""
    keys = chain(8, start=4096)
    store.wait_served()
    with SyncKVStoreClient(store.meta_addr, ClientConfig(transport="shm")) as c:
        assert c.put(keys, [payload(k) for k in keys]).stored == 8
        acquires = c.stats().counters["acquires"]
        n, out = read(c, keys)
        assert n == 8 and all(np.array_equal(o, payload(k)) for o, k in zip(out, keys))
        assert c.stats().counters["acquires"] == acquires
        assert c.location_stats()["hits"] == 8 and c.location_stats()["stale"] == 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_stale_location_falls_back_to_the_leased_path(store, transport):
    keys = chain(4)
    store.wait_served()
    cfg = ClientConfig(transport=transport)
    with SyncKVStoreClient(store.meta_addr, cfg) as reader, SyncKVStoreClient(store.meta_addr, cfg) as writer:
        writer.put(keys, [payload(k) for k in keys])
        assert read(reader, keys)[0] == 4
        assert writer.remove(keys) == 4
        assert read(reader, keys)[0] == 0  # the known locations no longer hold the blocks: a miss
        assert reader.location_stats()["stale"] >= 1
        # Stored again (another generation, maybe another extent): read whole through a lease.
        writer.put(keys, [payload(k) for k in keys])
        n, out = read(reader, keys)
        assert n == 4 and all(np.array_equal(o, payload(k)) for o, k in zip(out, keys))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_reads_racing_eviction_and_reuse_never_return_another_blocks_bytes(cluster, transport):
    """A writer cycles 48 blocks through a DRAM segment that holds about 30, so extents are
    evicted and reused all the time; a reader keeps reading blocks whose locations it learned
    earlier. Every block it gets must be that block's bytes."""
    cluster.start_meta()
    cluster.start_daemon(dram="2MiB")
    cluster.wait_served()
    keys = chain(48)
    cfg = ClientConfig(transport=transport)
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with SyncKVStoreClient(cluster.meta_addr, cfg) as w:
                i = 0
                while not stop.is_set() and i < 20_000:
                    k = keys[i % len(keys)]
                    w.put([k], [payload(k)], chain=False)
                    i += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=write)
    t.start()
    got = wrong = 0
    rng = np.random.default_rng(0)
    try:
        with SyncKVStoreClient(cluster.meta_addr, cfg) as r:
            deadline = time.monotonic() + 20
            reads = 0
            while reads < 3000 and time.monotonic() < deadline:
                k = keys[int(rng.integers(len(keys)))]
                out = np.zeros(SIZE, np.uint8)
                if r.get_into([k], [out]) == 1:
                    got += 1
                    wrong += int(not np.array_equal(out, payload(k)))
                reads += 1
            stats = r.location_stats()
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert wrong == 0
    assert got > 100
    # The race was run: blocks came from known locations, and known locations went stale.
    assert stats["hits"] > 50 and stats["stale"] > 10, stats


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_warm_caches_survive_daemon_and_metadata_restarts(cluster, transport):
    meta = cluster.start_meta()
    addr = cluster.meta_addr
    daemon = cluster.start_daemon(name="warm")
    cluster.wait_served()
    keys = chain(6)
    with SyncKVStoreClient(addr, ClientConfig(transport=transport, rpc_timeout_s=2)) as c:
        c.put(keys, [payload(k) for k in keys])
        assert read(c, keys)[0] == 6
        # The metadata service goes away: known blocks are still read, and right.
        meta.kill()
        n, out = read(c, keys)
        assert n == 6 and all(np.array_equal(o, payload(k)) for o, k in zip(out, keys))
        cluster.start_meta(listen=addr)
        wait_until(lambda: stored(c, keys) == 6)
        assert read(c, keys)[0] == 6
        # The daemon restarts (SIGKILL, then the same arena): its blocks come back with it.
        daemon.kill()
        assert read(c, keys)[0] in (0, 6)  # dead: known locations are refused; leases may still be handed out
        cluster.start_daemon(name="warm")
        wait_until(lambda: stored(c, keys) == 6)
        n, out = read(c, keys)
        assert n == 6 and all(np.array_equal(o, payload(k)) for o, k in zip(out, keys))


def test_a_block_the_service_refused_at_re_registration_is_not_read_from_a_known_location(cluster):
    """A daemon dies; its block leaves the index and is stored anew elsewhere; the daemon comes
    back with its old copy, which the service refuses (the key lives on the other daemon). A
    reader that remembers the old location must not get the old copy from there."""
    cluster.start_meta()
    cluster.start_daemon(name="first", dram="8MiB")
    cluster.wait_served()
    keys = chain(3)
    old = [payload(k) for k in keys]
    with SyncKVStoreClient(cluster.meta_addr) as reader:
        with SyncKVStoreClient(cluster.meta_addr) as w:
            assert w.put(keys, old).stored == 3
        assert read(reader, keys)[0] == 3  # the reader now knows where they are
        first = cluster.procs[-1]
        first.kill()
        reader.advance_clock(5)  # past the liveness deadline: the blocks leave the index
        wait_until(lambda: stored(reader, keys) == 0)
        cluster.start_daemon(name="second", dram="8MiB")
        new = [np.full(SIZE, 7, np.uint8) for _ in keys]  # other bytes under the same keys
        with SyncKVStoreClient(cluster.meta_addr) as w:
            assert w.put(keys, new).stored == 3
        cluster.start_daemon(name="first", dram="8MiB")  # back, with its old copies
        cluster.wait_served()
        for _ in range(20):
            n, out = read(reader, keys)
            assert n == 3 and all(np.array_equal(o, b) for o, b in zip(out, new)), "the refused copy was read"
