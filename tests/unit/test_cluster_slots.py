"""Slots, arenas and the merging of shards' answers (kvstore.cluster.slots, kvstore.client.shards)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore import tickets
from kvstore.client.fanout import leading, merge_locations
from kvstore.client.shards import cluster_url
from kvstore.cluster.coord import Leader, parse_url
from kvstore.cluster.slots import SLOTS, SlotMap, arena, arena_of
from kvstore.errors import InvalidArgument
from kvstore.v1 import common_pb2
from kvstore.wire import ROW_DTYPE, locations_from_pb


def test_even_map_splits_slots_evenly_and_round_trips():
    for shards in (1, 2, 3, 4, 7):
        m = SlotMap.even(shards)
        counts = np.bincount(m.owners, minlength=shards)
        assert m.shards == shards and counts.sum() == SLOTS
        assert counts.max() - counts.min() <= 1
        assert (SlotMap.decode(m.encode()).owners == m.owners).all()


def test_shards_of_matches_slot_of_key_by_key():
    m = SlotMap.even(4)
    keys = [os.urandom(16) for _ in range(500)]
    packed = b"".join(keys)
    vec = m.shards_of(packed)
    assert [int(v) for v in vec] == [m.shard_of(k) for k in keys]
    split = m.split(packed)
    assert sorted(int(p) for pos in split.values() for p in pos) == list(range(500))
    for s, pos in split.items():
        assert all(m.shard_of(keys[int(p)]) == s for p in pos)
        assert list(pos) == sorted(pos)


def test_bad_input_is_refused_by_name():
    with pytest.raises(InvalidArgument, match="whole number"):
        SlotMap.even(2).shards_of(b"x" * 17)
    with pytest.raises(InvalidArgument, match="shards"):
        SlotMap.even(0)
    with pytest.raises(InvalidArgument, match="slots"):
        SlotMap([0, 1])
    with pytest.raises(InvalidArgument, match="cluster.redis"):
        parse_url("http://x:1")
    with pytest.raises(InvalidArgument, match="master"):
        parse_url("sentinel://a:1,b:2")


def test_urls():
    assert parse_url("redis://10.0.0.1:6379/2") == ("redis", [("10.0.0.1", 6379)], "", 2)
    assert parse_url("sentinel://a:1,b:2/kvs") == ("sentinel", [("a", 1), ("b", 2)], "kvs", 0)
    assert cluster_url("redis://h:1#prod") == ("redis://h:1", "prod")
    assert cluster_url("127.0.0.1:7100") is None
    assert Leader.parse(b"meta-a-1|10.0.0.1:7100|42") == Leader("meta-a-1", "10.0.0.1:7100", 42)


@pytest.mark.parametrize("capacity", [64 << 20, (64 << 20) + 12345, 1 << 30])
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_arenas_are_disjoint_aligned_and_found_again(capacity, shards):
    align = 4096
    spans = [arena(capacity, align, k, shards) for k in range(shards)]
    end = 0
    for k, (base, size) in enumerate(spans):
        assert base % align == 0 and size % align == 0 and size > 0
        assert base >= end  # disjoint, in order
        end = base + size
        assert arena_of(base, capacity, align, shards) == k
        assert arena_of(base + size - align, capacity, align, shards) == k
    assert end <= capacity


def test_leading_hit_is_the_first_miss_over_all_shards():
    # keys 0..5: shard A holds 0, 2, 4; shard B holds 1, 3, 5
    a, b = np.array([0, 2, 4]), np.array([1, 3, 5])
    assert min(leading(a, 3, 6), leading(b, 1, 6)) == 3  # B misses key 3
    assert min(leading(a, 3, 6), leading(b, 3, 6)) == 6
    assert min(leading(a, 0, 6), leading(b, 3, 6)) == 0


def _loc(rows: list[tuple[int, int]], daemon: str, with_tickets: bool) -> common_pb2.Locations:
    r = np.zeros(len(rows), dtype=ROW_DTYPE)
    for i, (off, csum) in enumerate(rows):
        r[i] = (7, 0, off, 100, csum, off + 1)
    info = common_pb2.DaemonInfo(
        daemon_id=daemon, segments=[common_pb2.Segment(segment_id=1, tier=1, capacity_bytes=1 << 20)]
    )
    return common_pb2.Locations(
        rows=r.tobytes(),
        segments=[common_pb2.SegmentRef(ref=7, daemon=info, segment_id=1, tier=1)],
        tickets=b"".join(tickets.TICKET.pack(bytes([i]) * 16, 99) for i in range(len(rows))) if with_tickets else b"",
    )


def test_merged_locations_keep_each_row_with_its_daemon_and_ticket():
    # Both shards number their segment 7: the merge renumbers so that rows keep their daemon.
    a = _loc([(0, 10), (4096, 11)], "A", True)
    b = _loc([(8192, 20)], "B", True)
    merged = merge_locations([(a, [0, 2]), (b, [1])], 3, os.urandom(48))
    places = locations_from_pb(merged, 3)
    assert [(p.daemon.daemon_id, p.offset, p.checksum) for p in places] == [
        ("A", 0, 10),
        ("B", 8192, 20),
        ("A", 4096, 11),
    ]
    assert places[1].ticket == tickets.TICKET.pack(bytes([0]) * 16, 99)
    assert places[2].ticket == tickets.TICKET.pack(bytes([1]) * 16, 99)


def test_merge_takes_only_the_rows_before_the_merged_hit_count():
    a = _loc([(0, 10), (4096, 11), (8192, 12)], "A", False)  # shard A hit 3 of its keys
    b = _loc([(0, 20)], "B", False)  # shard B missed its second key: the chain ends there
    merged = merge_locations([(a, [0]), (b, [1])], 2, os.urandom(32))
    places = locations_from_pb(merged, 2)
    assert [(p.daemon.daemon_id, p.checksum) for p in places] == [("A", 10), ("B", 20)]


async def test_a_caller_that_gives_up_does_not_fail_the_others_in_its_batch():
    import asyncio

    from kvstore.client.fanout import Coalescer
    from kvstore.v1 import meta_pb2

    hold = asyncio.Event()
    sent: list[int] = []

    class FakeMeta:
        async def lookup_on_stream(self, shard, request, timeout=None):  # noqa: ANN001, ANN202
            n = len(request.keys) // 16
            sent.append(n)
            await hold.wait()
            # every key whose first byte is odd is stored
            return meta_pb2.LookupResponse(
                exists=bytes(k[0] & 1 for k in (request.keys[i : i + 16] for i in range(0, len(request.keys), 16)))
            )

    c = Coalescer(FakeMeta(), 0)
    k_odd, k_even = b"\x01" * 16, b"\x02" * 16
    first = [asyncio.ensure_future(c.exists(k_odd, 5)) for _ in range(2)]  # two calls in flight
    await asyncio.sleep(0)
    queued = [asyncio.ensure_future(c.exists(k, 5)) for k in (k_even, k_odd + k_even, k_odd)]
    await asyncio.sleep(0)
    queued[0].cancel()  # gives up while waiting
    hold.set()
    assert [list(f) for f in await asyncio.gather(*first)] == [[1], [1]]
    assert list(await queued[1]) == [1, 0] and list(await queued[2]) == [1]
    # Calls shared between callers (fewer calls than callers), and without the one that gave up.
    assert sum(sent) == 2 + 3 and len(sent) < 4


async def test_a_failed_shared_call_fails_each_caller_once_and_none_waits():
    import asyncio

    from kvstore.client.fanout import Coalescer
    from kvstore.errors import Unavailable

    class Down:
        async def lookup_on_stream(self, shard, request, timeout=None):  # noqa: ANN001, ANN202
            await asyncio.sleep(0.01)
            raise Unavailable("shard 0 has no leader")

    c = Coalescer(Down(), 0)
    res = await asyncio.wait_for(
        asyncio.gather(*(c.exists(b"\x01" * 16, 1) for _ in range(5)), return_exceptions=True), 5
    )
    assert all(isinstance(r, Unavailable) for r in res)
