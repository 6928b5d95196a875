"""Eviction under pressure, through real processes: leased and pinned extents survive, the
tail of a chain goes before its head."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.errors import ResourceExhausted
from kvstore.keys import pack_keys
from kvstore.v1 import meta_pb2, meta_pb2_grpc
from kvstore.wire import locations_from_pb

KS = KeySpace(ModelFingerprint("evict", "bf16", 2, 2, 64))
BLOCK = 1 << 20  # 1 MiB blocks in a 4 MiB segment: room for 3 (each extent has a header)


def chain(n: int, start: int) -> list[bytes]:
    return KS.block_keys(np.arange(start, start + 16 * n))


def fill(n: int, v: int) -> list[np.ndarray]:
    return [np.full(BLOCK, (v + i) % 256, np.uint8) for i in range(n)]


def test_held_lease_is_never_evicted(cluster):
    cluster.start_meta()
    cluster.start_daemon(dram="4MiB")
    a = chain(2, 0)
    a_data = fill(2, 10)
    with SyncKVStoreClient(cluster.meta_addr) as c, grpc.insecure_channel(cluster.meta_addr) as ch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        c.put(a, a_data)
        # Hold a read lease on chain a, as a reader in the middle of its copy would.
        lease = stub.Acquire(meta_pb2.AcquireRequest(keys=pack_keys(a), ttl_ms=60000))
        assert lease.hit_count == 2
        locs = locations_from_pb(lease.locations, 2)
        # Pressure: more than the segment holds. Only the one free slot can be used.
        b = chain(3, 1000)
        res = c.put(b, fill(3, 50))
        assert res.stored == 1 and res.rejected == 2
        assert c.lookup(a) == 2
        # The leased bytes are intact where the lease says they are.
        raw = open(cluster.shm_paths[0], "rb").read()
        for loc, d in zip(locs, a_data):
            assert raw[loc.offset + 64 : loc.offset + 64 + BLOCK] == d.tobytes()
        # Nothing evictable at all: RESOURCE_EXHAUSTED, nothing stored changes.
        assert c.pin(b[:1]) == 1
        with pytest.raises(ResourceExhausted, match="leased, pinned or being written"):
            c.put(chain(1, 5000), fill(1, 90))
        assert c.lookup(a) == 2 and c.lookup(b) == 1
        # Once released, chain a becomes evictable again.
        stub.Release(meta_pb2.ReleaseRequest(lease_id=lease.lease_id))
        assert c.put(chain(2, 7000), fill(2, 3)).stored == 2
        assert c.lookup(a) == 0
        assert c.stats().counters["evictions"] == 2


def test_chain_tail_is_evicted_before_head(cluster):
    cluster.start_meta()
    cluster.start_daemon(dram="4MiB")
    a = chain(3, 0)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        c.put(a, fill(3, 1))
        # One new block needs one slot: the tail of chain a goes, its head stays.
        c.put(chain(1, 9000), fill(1, 7))
        assert c.exists(a) == [True, True, False]
        c.put(chain(1, 9100), fill(1, 8))
        assert c.exists(a) == [True, False, False]
