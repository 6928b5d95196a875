"""An aborted put's extent goes to no other put while the aborted put's write tickets may still be
honoured (kvstore.meta.quarantine), on a real service and daemon."""

from __future__ import annotations

import numpy as np
from conftest import locations, raw_call

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.extent import ALIGN, extent_size
from kvstore.v1 import meta_pb2
from kvstore.wire import U64, locations_from_pb, pack

KS = KeySpace(ModelFingerprint("quarantine", "bf16", 2, 2, 64))
KEYS = KS.block_keys(np.arange(64 * 4))
N = 4096


def test_an_aborted_puts_extent_is_not_handed_to_the_next_put(store) -> None:
    r = raw_call(store.meta_addr, "PutStart", meta_pb2.PutStartRequest(keys=KEYS[0], sizes=pack([N], U64)))
    (aborted,) = locations_from_pb(r.placements, 1)
    assert raw_call(store.meta_addr, "PutAbort", meta_pb2.PutAbortRequest(put_id=r.put_id)).released == 1
    with SyncKVStoreClient(store.meta_addr, ClientConfig(location_cache=0)) as c:
        data = [np.full(N, 7, np.uint8), np.full(N, 8, np.uint8)]
        assert c.put(KEYS[1:3], data).stored == 2
        placed = locations(store.meta_addr, KEYS[1:3])
        assert len(placed) == 2
        size = extent_size(N, ALIGN)
        for p in placed:  # no overlap with the aborted put's extent
            assert p.offset + size <= aborted.offset or aborted.offset + size <= p.offset, (p.offset, aborted.offset)
        s = c.stats()
        assert s.pending_puts == 0 and s.segments[0].blocks == 2
        out = [np.zeros(N, np.uint8) for _ in range(2)]
        assert c.get_into(KEYS[1:3], out) == 2
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
