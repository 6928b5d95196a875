"""A registration whose inventory names a generation the index could never have handed out is
refused whole (INVALID_ARGUMENT), and the service goes on taking puts on its real daemons."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import raw_call

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.errors import InvalidArgument
from kvstore.v1 import common_pb2, meta_pb2
from kvstore.wire import U64, pack

KS = KeySpace(ModelFingerprint("generations", "bf16", 2, 2, 64))
KEYS = KS.block_keys(np.arange(64 * 8))


@pytest.mark.parametrize("gen", [2**64 - 1, 2**63])
def test_a_registration_naming_a_generation_past_the_range_is_refused_and_puts_go_on(store, gen: int) -> None:
    with SyncKVStoreClient(store.meta_addr) as c:
        assert c.put(KEYS[:1], [np.zeros(100, np.uint8)]).stored == 1
    info = common_pb2.DaemonInfo(
        daemon_id="rogue",
        host_id="elsewhere",
        data_addr="127.0.0.1:1",
        control_addr="127.0.0.1:1",
        segments=[common_pb2.Segment(segment_id=1, tier=1, capacity_bytes=1 << 20)],
    )
    inv = common_pb2.Inventory(
        segment_id=1, keys=KEYS[7], offset=pack([0], U64), length=pack([100], U64),
        checksum=pack([5], U64), gen=pack([gen], U64),
    )  # fmt: skip
    with pytest.raises(InvalidArgument, match=rf"item 0 \(key {KEYS[7].hex()}\): generation {gen} is outside"):
        raw_call(store.meta_addr, "RegisterDaemon", meta_pb2.RegisterDaemonRequest(daemon=info, inventory=[inv]))
    with SyncKVStoreClient(store.meta_addr) as c:
        s = c.stats()
        assert len(s.daemons) == 1 and s.daemons[0].info.daemon_id != "rogue"
        data = [np.full(5000, i, np.uint8) for i in range(3)]
        assert c.put(KEYS[1:4], data).stored == 3
        out = [np.zeros(5000, np.uint8) for _ in range(3)]
        assert c.get_into(KEYS[1:4], out) == 3
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        s = c.stats()
        assert s.keys == 4 and s.pending_puts == 0 and s.segments[0].blocks == 4
