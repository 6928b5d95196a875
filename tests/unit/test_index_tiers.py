"""Tier moves in the index (kvstore.meta.tiers): least recently used blocks go from a
daemon's DRAM above its high watermark to its SSD, the row following the block; a move that
fails, or whose block was removed, re-put, pinned or leased meanwhile, or whose daemon left,
leaves every extent accounted for and every answer right. Random operation sequences check the
accounting at every step and that every location handed out holds the block's own checksum."""

from __future__ import annotations

import random

import pytest

from kvstore.extent import ALIGN, HEADER_SIZE, SSD_ALIGN
from kvstore.meta.index import DaemonSpec, Index, IndexLimits, SegmentSpec, Tier
from tests.unit.test_index import FakeClock

BLK = ALIGN - HEADER_SIZE


def key(i: int) -> bytes:
    return random.Random(i).getrandbits(128).to_bytes(16, "little")


def csum(k: bytes) -> int:
    return int.from_bytes(k[8:], "little") | 1


def tiered(dram_slots: int = 8, ssd_slots: int = 16, high: float = 0.5, low: float = 0.25):  # noqa: ANN201
    clock = FakeClock()
    ix = Index(IndexLimits(cache_policy="lru", dram_high_watermark=high, dram_low_watermark=low), clock)
    segs = (
        SegmentSpec(1, Tier.DRAM, dram_slots * ALIGN, "/dev/shm/d1"),
        SegmentSpec(2, Tier.SSD, ssd_slots * SSD_ALIGN, "/data/d1"),
    )
    assert ix.register_daemon(DaemonSpec("d1", "h1", "d1:data", "d1:ctl", segs), {}) == 0
    return ix, clock


def put(ix: Index, *ids: int) -> None:
    keys = [key(i) for i in ids]
    p = ix.put_start(b"".join(keys), [BLK] * len(keys))
    assert ix.put_commit(p.put_id, [csum(k) for k in keys]) == len(keys)


def tiers_of(ix: Index, *ids: int) -> list[int]:
    return list(ix.tiers(b"".join(key(i) for i in ids))[0])


def dram_ssd(ix: Index):  # noqa: ANN201
    d = ix.daemons["d1"]
    return d.tier(Tier.DRAM), d.tier(Tier.SSD)


def test_dram_above_its_high_watermark_sends_its_least_recent_blocks_to_ssd() -> None:
    ix, _ = tiered()
    put(ix, 1, 2)
    put(ix, 3, 4)
    put(ix, 5)
    dram, ssd = dram_ssd(ix)
    plans = ix.plan_moves()
    moves = plans["d1"]
    # 5 of 8 DRAM extents used, above half: down to a quarter, the least recent first (a chain's
    # tail before its head).
    assert [m.src.key for m in moves] == [key(2), key(1), key(4)]
    assert all(m.dst.segment is ssd and m.src.segment is dram for m in moves)
    assert ix.plan_moves() == {"d1": []} or ix.plan_moves() == {}  # nothing planned twice
    ix.check_integrity()
    for m in moves:
        ix.finish_move(m.move_id, True)
    ix.check_integrity()
    assert tiers_of(ix, 1, 2, 3, 4, 5) == [2, 2, 1, 2, 1]  # bit 0: DRAM, bit 1: SSD
    assert dram.alloc.used == 2 * ALIGN and ssd.blocks == 3
    n, _, rows = ix.lookup(b"".join(key(i) for i in (1, 2)), with_locations=True)
    assert n == 2 and [x.checksum for x in ix.locations(rows)] == [csum(key(1)), csum(key(2))]
    dead = ix.take_tombstones()["d1"]
    assert sorted(t.key for t in dead) == sorted([key(1), key(2), key(4)]) and {t.segment_id for t in dead} == {1}
    assert ix.counters["demoted"] == 3


def test_blocks_read_from_ssd_come_back_to_dram_and_keep_their_ssd_copy() -> None:
    ix, _ = tiered(dram_slots=8, high=0.5, low=0.0)
    put(ix, 1, 2, 3, 4, 5)
    for m in ix.plan_moves()["d1"]:  # all of DRAM to SSD
        ix.finish_move(m.move_id, True)
    assert tiers_of(ix, 1, 2, 3, 4, 5) == [2] * 5
    ix.take_tombstones()
    lease = ix.acquire(b"".join(key(i) for i in (1, 2, 3)))
    ix.release(lease.lease_id)
    dram, ssd = dram_ssd(ix)
    moves = ix.plan_moves()["d1"]
    # Into DRAM up to halfway between the high watermark and full (6 of 8 extents): all three.
    assert [(m.src.key, m.demote) for m in moves] == [(key(i), False) for i in (1, 2, 3)]
    assert all(m.src.segment is ssd and m.dst.segment is dram for m in moves)
    assert ix.plan_moves() == {}  # not planned twice
    for m in moves:
        ix.finish_move(m.move_id, True)
    ix.check_integrity()
    # Both tiers hold 1-3 (bit 0: DRAM, bit 1: SSD); the SSD copies stay, clean: no tombstone.
    assert tiers_of(ix, 1, 2, 3, 4, 5) == [3, 3, 3, 2, 2] and ix.counters["promoted"] == 3
    assert ssd.blocks == 5 and ssd.alloc.used == 5 * SSD_ALIGN and dram.blocks == 3
    assert ix.take_tombstones() == {}
    n, _, rows = ix.lookup(b"".join(key(i) for i in (1, 2, 3, 4, 5)), with_locations=True)
    assert n == 5 and [x.checksum for x in ix.locations(rows)] == [csum(key(i)) for i in (1, 2, 3, 4, 5)]
    # Readers get the DRAM replica.
    assert [x.segment for x in ix.locations(rows[:3])] == [dram] * 3


def promoted(ix: Index, *ids: int) -> None:
    """Demotes everything in DRAM to SSD, then reads ``ids`` and promotes them back."""
    for m in ix.plan_moves().get("d1", []):
        ix.finish_move(m.move_id, True)
    lease = ix.acquire(b"".join(key(i) for i in ids))
    ix.release(lease.lease_id)
    for m in ix.plan_moves()["d1"]:
        assert not m.demote
        ix.finish_move(m.move_id, True)
    ix.take_tombstones()
    ix.check_integrity()


def test_demoting_a_block_with_a_clean_ssd_copy_drops_its_dram_copy_without_a_move() -> None:
    ix, _ = tiered(dram_slots=8, high=0.5, low=0.0)
    put(ix, 1, 2, 3, 4, 5)
    promoted(ix, 1, 2, 3)
    dram, ssd = dram_ssd(ix)
    put(ix, 6, 7)  # DRAM 5 of 8: above the high watermark again
    moves = ix.plan_moves()["d1"]
    # 1-3 had SSD copies: dropped from DRAM at once; 6 and 7 are moved.
    assert sorted(m.src.key for m in moves) == sorted([key(6), key(7)])
    assert ix.counters["dropped_clean"] == 3
    dead = ix.take_tombstones()["d1"]
    assert {(t.segment_id, t.key) for t in dead} == {(1, key(i)) for i in (1, 2, 3)}
    for m in moves:
        ix.finish_move(m.move_id, True)
    ix.check_integrity()
    assert tiers_of(ix, 1, 2, 3, 4, 5, 6, 7) == [2] * 7 and dram.blocks == 0 and ssd.blocks == 7
    n, _, rows = ix.lookup(b"".join(key(i) for i in range(1, 8)), with_locations=True)
    assert n == 7 and [x.checksum for x in ix.locations(rows)] == [csum(key(i)) for i in range(1, 8)]


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_a_put_short_of_dram_drops_dram_copies_of_blocks_with_a_clean_ssd_copy(policy: str) -> None:
    clock = FakeClock()
    ix = Index(IndexLimits(cache_policy=policy, dram_high_watermark=0.99, dram_low_watermark=0.0), clock)
    segs = (SegmentSpec(1, Tier.DRAM, 4 * ALIGN, "/dev/shm/d1"), SegmentSpec(2, Tier.SSD, 16 * SSD_ALIGN, "/d"))
    ix.register_daemon(DaemonSpec("d1", "h1", "d1:data", "d1:ctl", segs), {})
    put(ix, 1, 2, 3, 4)
    for m in ix.plan_moves()["d1"]:
        ix.finish_move(m.move_id, True)
    lease = ix.acquire(b"".join(key(i) for i in (1, 2)))
    ix.release(lease.lease_id)
    for m in ix.plan_moves()["d1"]:
        ix.finish_move(m.move_id, True)
    put(ix, 5, 6)  # DRAM: 1, 2 (with SSD copies), 5, 6: full
    ix.take_tombstones()
    dram, ssd = dram_ssd(ix)
    assert dram.alloc.used == 4 * ALIGN
    p = ix.put_start(key(7), [BLK])  # DRAM has room only where 1 or 2 drop their DRAM copy
    assert p.status == [0] and ix.locations(p.placements)[0].segment is dram
    assert ix.put_commit(p.put_id, [csum(key(7))]) == 1
    ix.check_integrity()
    assert ix.counters["dropped_clean"] == 1 and ix.counters["evictions"] == 0
    assert sorted(tiers_of(ix, 1, 2)) == [2, 3] and tiers_of(ix, 5, 6, 7) == [1, 1, 1]
    assert len(ix) == 7  # nothing was lost


def test_ssd_eviction_drops_a_clean_copy_and_keeps_its_block_in_dram() -> None:
    ix, _ = tiered(dram_slots=8, ssd_slots=5, high=0.5, low=0.0)
    put(ix, 1, 2, 3, 4, 5)
    promoted(ix, 1, 2)  # SSD: 3, 4, 5 and copies of 1 and 2; DRAM: 1 and 2
    dram, ssd = dram_ssd(ix)
    assert ssd.alloc.used == 5 * SSD_ALIGN and ssd.blocks == 5
    lease = ix.acquire(b"".join(key(i) for i in (1, 2)))  # 1 and 2 the most recent
    ix.release(lease.lease_id)
    big = SSD_ALIGN - HEADER_SIZE  # larger than all of DRAM: only the SSD takes it
    for n, x in enumerate((10, 11, 12, 13), 1):
        p = ix.put_start(key(x), [big])
        assert p.status == [0] and ix.locations(p.placements)[0].segment is ssd
        assert ix.put_commit(p.put_id, [csum(key(x))]) == 1
        ix.check_integrity()
        if n <= 3:  # 3, 4 and 5, the least recent, leave whole (the chain's tail first)
            assert ix.counters["evictions"] == n and hits_of(ix, 6 - n) == 0
    # The fourth takes the place of 2's SSD copy (the chain's tail): a clean drop; 2 is still
    # in DRAM.
    assert ix.counters["dropped_clean"] == 1 and ix.counters["evictions"] == 3
    assert tiers_of(ix, 1, 2) == [3, 1] and hits_of(ix, 1, 2) == 2
    dead = ix.take_tombstones()["d1"]
    assert [(t.segment_id, t.key) for t in dead][-1] == (2, key(2))
    assert dram.blocks == 2 and ssd.blocks == 5


def hits_of(ix: Index, *ids: int) -> int:
    return ix.lookup(b"".join(key(i) for i in ids))[0]


def test_a_registration_with_a_block_on_both_tiers_adopts_the_ssd_one_as_a_clean_copy() -> None:
    from kvstore.meta.records import InventoryItem

    ix, _ = tiered()
    d = ix.daemons["d1"]
    spec = d.spec
    inv = {
        1: [
            InventoryItem(key(1), 0, BLK, csum(key(1)), gen=11),
            InventoryItem(key(2), ALIGN, BLK, csum(key(2)), gen=12),
        ],
        2: [
            InventoryItem(key(1), 0, BLK, csum(key(1)), gen=13),  # a clean copy of 1
            InventoryItem(key(2), SSD_ALIGN, BLK + 1, csum(key(2)), gen=14),  # another length: refused
            InventoryItem(key(3), 2 * SSD_ALIGN, BLK, csum(key(3)), gen=15),
        ],
    }
    assert ix.register_daemon(spec, inv) == 1
    ix.check_integrity()
    assert tiers_of(ix, 1, 2, 3) == [3, 1, 2]
    dram, ssd = dram_ssd(ix)
    assert dram.blocks == 2 and ssd.blocks == 2
    assert [(t.key, t.gen) for t in ix.take_tombstones()["d1"]] == [(key(2), 14)]
    # Dropping the block drops both replicas: two tombstones.
    assert ix.remove(key(1)) == 1
    assert sorted((t.segment_id, t.gen) for t in ix.take_tombstones()["d1"]) == [(1, 11), (2, 13)]
    ix.check_integrity()


def test_a_damaged_clean_copy_or_primary_drops_only_that_replica() -> None:
    ix, _ = tiered(dram_slots=8, high=0.5, low=0.0)
    put(ix, 1, 2, 3, 4, 5)
    for m in ix.plan_moves()["d1"]:
        ix.finish_move(m.move_id, True)
    old = ix.acquire(b"".join(key(i) for i in (1, 2)))  # reads the SSD copies
    for m in ix.plan_moves()["d1"]:
        ix.finish_move(m.move_id, True)
    ix.take_tombstones()
    # The reader of the SSD copy of 1 reports it damaged: that copy goes, DRAM's stays.
    ix.release(old.lease_id, corrupt=[0])
    ix.check_integrity()
    assert tiers_of(ix, 1, 2) == [1, 3] and [t.segment_id for t in ix.take_tombstones()["d1"]] == [2]
    # A reader of the DRAM replica of 2 reports it damaged: the block stays, on SSD.
    lease = ix.acquire(b"".join(key(i) for i in (1, 2)))
    ix.release(lease.lease_id, corrupt=[1])
    ix.check_integrity()
    assert tiers_of(ix, 1, 2) == [1, 2] and [t.segment_id for t in ix.take_tombstones()["d1"]] == [1]
    assert ix.counters["corrupt_reported"] == 2


def test_pins_and_daemon_loss_count_every_replica() -> None:
    ix, _ = tiered(dram_slots=8, high=0.5, low=0.0)
    put(ix, 1, 2, 3, 4, 5)
    promoted(ix, 1, 2)
    dram, ssd = dram_ssd(ix)
    assert ix.pin(b"".join(key(i) for i in (1, 3))) == 2
    ix.check_integrity()
    assert dram.pinned == 1 and ssd.pinned == 2
    assert ix.pin(key(1), False) == 1
    ix.check_integrity()
    assert dram.pinned == 0 and ssd.pinned == 1
    lease = ix.acquire(b"".join(key(i) for i in (1, 2)))
    ix._drop_daemon("d1")
    ix.check_integrity()
    assert len(ix) == 0
    ix.release(lease.lease_id)
    ix.check_integrity()
    assert ix.segments == {}


def test_a_failed_move_leaves_the_block_in_dram_and_the_ssd_copy_is_forgotten() -> None:
    ix, _ = tiered()
    put(ix, 1, 2, 3, 4, 5)
    moves = ix.plan_moves()["d1"]
    ix.finish_move(moves[0].move_id, False)
    ix.check_integrity()
    assert tiers_of(ix, 5)[0] == 1 and ix.counters["moves_failed"] == 1
    dead = ix.take_tombstones()["d1"]
    assert [(t.segment_id, t.key, t.gen) for t in dead] == [(2, moves[0].dst.key, moves[0].dst.gen)]
    for m in moves[1:]:
        ix.finish_move(m.move_id, True)
    ix.check_integrity()


def test_a_block_removed_or_re_put_while_it_moves_is_not_brought_back() -> None:
    ix, _ = tiered()
    put(ix, 1, 2, 3, 4, 5)
    moves = ix.plan_moves()["d1"]
    gone = moves[0].src.key
    assert ix.remove(gone) == 1
    ix.check_integrity()
    p = ix.put_start(gone, [BLK])  # put again meanwhile: a new block under the same key
    assert ix.put_commit(p.put_id, [7]) == 1
    for m in moves:
        ix.finish_move(m.move_id, True)
    ix.check_integrity()
    n, _, rows = ix.lookup(gone, with_locations=True)
    assert n == 1 and ix.locations(rows)[0].checksum == 7 and ix.locations(rows)[0].segment.spec.tier == Tier.DRAM
    assert ix.counters["demoted"] == len(moves) - 1 and ix.counters["moves_failed"] == 1


def test_a_block_read_while_it_moves_keeps_its_dram_copy_until_the_reads_can_have_ended() -> None:
    ix, clock = tiered()
    put(ix, 1, 2, 3, 4, 5)
    moves = ix.plan_moves()["d1"]
    m = moves[0]
    lease = ix.acquire(b"".join(key(i) for i in (1, 2, 3, 4, 5)), ttl_s=5.0)
    assert ix.locations(lease.locations)[4].offset == m.src.offset  # the reader reads the DRAM copy
    for mv in moves:
        ix.finish_move(mv.move_id, True)
    ix.check_integrity()
    dram, _ = dram_ssd(ix)
    assert dram.quarantined >= m.src.size  # the DRAM copies under the lease are held back
    before = dram.alloc.used
    ix.release(lease.lease_id)
    clock.advance(6.0)
    ix.heartbeat("d1")
    ix.expire()
    ix.check_integrity()
    assert dram.quarantined == 0 and dram.alloc.used < before


@pytest.mark.parametrize("leaving", ["lost", "drained", "re-registered"])
def test_moves_of_a_daemon_that_leaves_end_unfinished(leaving: str) -> None:
    ix, clock = tiered()
    put(ix, 1, 2, 3, 4, 5)
    moves = ix.plan_moves()["d1"]
    spec = ix.daemons["d1"].spec
    if leaving == "lost":
        clock.advance(ix.limits.daemon_ttl_s + 1)
        assert ix.expire()["daemons"] == 1
    elif leaving == "drained":
        ix.drain_daemon("d1")
    else:
        ix.register_daemon(spec, {})
    assert not ix.moves and ix.counters["moves_failed"] == len(moves)
    for m in moves:
        ix.finish_move(m.move_id, True)  # the daemon's late answer changes nothing
    ix.check_integrity()
    assert ix.lookup(key(1))[0] == 0


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_with_moves_keep_the_accounting_and_every_answer_right(seed: int) -> None:
    rnd = random.Random(seed)
    ix, clock = tiered(dram_slots=12, ssd_slots=10, high=0.5, low=0.0)
    chains = [[1000 * c + i for i in range(rnd.randint(1, 6))] for c in range(8)]
    sums: dict[bytes, int] = {}  # key -> checksum of its committed block
    version = 0
    moves, leases = [], []
    for _ in range(1500):
        op = rnd.random()
        ids = rnd.choice(chains)[: rnd.randint(1, 6)]
        keys = [key(i) for i in ids]
        if op < 0.15:
            try:
                p = ix.put_start(b"".join(keys), [BLK] * len(keys))
            except Exception:  # noqa: BLE001 - no space: a typed error, checked below
                assert ix.counters["no_space_keys"] > 0
                continue
            version += 1
            new = [k for k, s in zip(keys, p.status) if s == 0]
            if not new:  # every key stored or being stored: nothing to commit
                continue
            got = [(k, version * 7919 + i) for i, k in enumerate(new)]
            if rnd.random() < 0.3:
                pc = ix.put_commit_begin(p.put_id, [c for _, c in got])
                outcome = {i: (rnd.choice((0, 2)), 0) for i in range(len(got)) if rnd.random() < 0.3}
                _, status = ix.put_commit_end(pc, outcome)
                sums.update((k, c) for (k, c), st in zip(got, status) if st == 0)
            else:
                ix.put_commit(p.put_id, [c for _, c in got])
                sums.update(got)
        elif op < 0.27:
            n, _, rows = ix.lookup(b"".join(keys), with_locations=True)
            for k, loc in zip(keys, ix.locations(rows)):
                assert loc.key == k and loc.checksum == sums[k], "a location with another block's checksum"
        elif op < 0.42:
            lease = ix.acquire(b"".join(keys), ttl_s=rnd.choice((1.0, 4.0)))
            for k, loc in zip(keys, ix.locations(lease.locations)):
                assert loc.checksum == sums[k]
            if lease.lease_id:
                leases.append(lease.lease_id)
        elif op < 0.52 and leases:
            lid = leases.pop(rnd.randrange(len(leases)))
            if lid in ix.leases:
                ix.release(lid, [0] if rnd.random() < 0.05 else [])
        elif op < 0.58:
            ix.remove(keys[-1])
        elif op < 0.62:
            ix.pin(b"".join(keys), rnd.random() < 0.5)
        elif op < 0.78:
            for ms in ix.plan_moves(max_bytes=rnd.choice((ALIGN, 4 * ALIGN, 64 * ALIGN))).values():
                moves.extend(ms)
        elif op < 0.93 and moves:
            m = moves.pop(rnd.randrange(len(moves)))
            ix.finish_move(m.move_id, rnd.random() < 0.85, rnd.choice((0, 0, SSD_ALIGN)))
        elif op < 0.97:
            clock.advance(rnd.choice((0.5, 2.0)))
            ix.heartbeat("d1")
            ix.expire()
        else:
            ix.take_tombstones()
        ix.check_integrity()
    assert ix.counters["demoted"] > 0 and ix.counters["promoted"] > 0 and ix.counters["moves_failed"] > 0


def test_a_damaged_copy_reported_after_its_block_moved_does_not_drop_the_new_copy() -> None:
    ix, _ = tiered()
    put(ix, 1, 2, 3, 4, 5)
    moves = ix.plan_moves()["d1"]
    lease = ix.acquire(b"".join(key(i) for i in (1, 2, 3, 4, 5)))
    for m in moves:
        ix.finish_move(m.move_id, True)
    moved = [key(i) for i in (1, 2, 3, 4, 5)].index(moves[0].src.key)
    ix.release(lease.lease_id, [moved])  # the DRAM copy it read was damaged: that copy is gone
    ix.check_integrity()
    assert ix.counters["corrupt_reported"] == 0 and ix.lookup(moves[0].src.key)[0] == 1
    lease = ix.acquire(b"".join(key(i) for i in (1, 2, 3, 4, 5)))
    ix.release(lease.lease_id, [moved])  # the SSD copy, read and damaged: dropped
    assert ix.counters["corrupt_reported"] == 1 and ix.lookup(moves[0].src.key)[0] == 0
    ix.check_integrity()


def test_a_block_larger_than_the_ssd_is_not_demoted_and_evicts_nothing_there() -> None:
    ix, _ = tiered(dram_slots=33, ssd_slots=1, high=0.1, low=0.0)
    big = 2 * SSD_ALIGN - HEADER_SIZE  # an 8 KiB extent: more than the whole 4 KiB SSD
    p = ix.put_start(key(1), [big])
    ix.put_commit(p.put_id, [1])
    p = ix.put_start(key(2), [300])  # no room left in DRAM: on SSD
    ix.put_commit(p.put_id, [2])
    assert tiers_of(ix, 1, 2) == [1, 2]
    assert ix.plan_moves() == {}
    assert tiers_of(ix, 1, 2) == [1, 2] and ix.counters["evictions"] == 0
    ix.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_a_put_into_full_tiers_evicts_on_the_ssd_and_keeps_every_dram_block(policy: str) -> None:
    """A block in DRAM without an SSD copy has no other copy: a put that finds DRAM and SSD full
    makes its room on the SSD (its least valuable block leaves) and lands there; no DRAM block
    is lost to a put."""
    ix = Index(IndexLimits(cache_policy=policy), FakeClock())
    segs = (SegmentSpec(1, Tier.DRAM, 4 * ALIGN, "/dev/shm/d1"), SegmentSpec(2, Tier.SSD, 4 * SSD_ALIGN, "/d1"))
    ix.register_daemon(DaemonSpec("d1", "h1", "d1:data", "d1:ctl", segs), {})
    for i in range(1, 10):  # 1-4 fill DRAM, 5-8 the SSD, 9 finds both full
        put(ix, i)
    assert ix.counters["evictions"] == 1
    ix.check_integrity()
    assert tiers_of(ix, *range(1, 10)) == [1, 1, 1, 1, 0, 2, 2, 2, 2]
