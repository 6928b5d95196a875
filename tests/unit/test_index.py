"""Unit tests for kvstore.meta.index.Index: pure state and policy, driven in-process with a fake clock."""

from __future__ import annotations

import itertools
import math
import random
from typing import NamedTuple

import numpy as np
import pytest

from kvstore.errors import Expired, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvstore.extent import ALIGN, HEADER_SIZE, SSD_ALIGN, extent_size
from kvstore.meta.index import (
    ROW,
    Clock,
    CommitStatus,
    DaemonSpec,
    Index,
    IndexLimits,
    InventoryItem,
    Location,
    PutStartResult,
    PutStatus,
    Segment,
    SegmentSpec,
    Tier,
    Tombstone,
)
from kvstore.meta.table import LIVE, PINNED, READY, words

BLK = ALIGN - HEADER_SIZE  # a payload that fills exactly one ALIGN slot
SEG = 1  # the segment id of the DRAM segment in the default daemon

ALLOCATED = PutStatus.ALLOCATED
SKIP_EXISTS = PutStatus.SKIP_EXISTS
SKIP_INFLIGHT = PutStatus.SKIP_INFLIGHT
NO_SPACE = PutStatus.NO_SPACE


class FakeClock(Clock):
    """A clock that moves only when told to."""

    def __init__(self, t: float = 1000.0) -> None:
        super().__init__()
        self.t = t

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


def k(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def pk(*ids: int) -> bytes:
    return b"".join(k(i) for i in ids)


def dspec(daemon_id: str = "d1", slots: int = 8, host: str = "h1", extra: tuple[SegmentSpec, ...] = ()) -> DaemonSpec:
    return DaemonSpec(
        daemon_id,
        host,
        f"{daemon_id}:data",
        f"{daemon_id}:ctl",
        (SegmentSpec(SEG, Tier.DRAM, slots * ALIGN, f"/dev/shm/{daemon_id}"), *extra),
    )


def make(slots: int = 8, **limits) -> tuple[Index, FakeClock]:
    clock = FakeClock()
    idx = Index(IndexLimits(**limits), clock)
    assert idx.register_daemon(dspec(slots=slots), {}) == 0
    idx.check_integrity()
    return idx, clock


def seg(idx: Index, daemon_id: str = "d1", segment_id: int = SEG):
    return idx.daemons[daemon_id].segments[segment_id]


def put(idx: Index, *ids: int, size: int = BLK) -> list[int]:
    """Starts and commits one put of ``ids``; returns its statuses."""
    r = idx.put_start(pk(*ids), [size] * len(ids))
    n = r.status.count(ALLOCATED)
    if n:
        assert idx.put_commit(r.put_id, [1000 + i for i in range(n)]) == n
    idx.check_integrity()
    return r.status


class Loc(NamedTuple):
    daemon_id: str
    segment_id: int
    offset: int
    length: int
    checksum: int
    tier: int


def L(loc: Location) -> Loc:  # noqa: N802
    """A location (what placements and locations spell out as) as a plain tuple."""
    seg_ = loc.segment
    return Loc(seg_.daemon.spec.daemon_id, seg_.spec.segment_id, loc.offset, loc.length, loc.checksum, seg_.spec.tier)


def locs_of(idx: Index, *ids: int) -> list[Loc]:
    """The locations of the leading run of ``ids``."""
    return [L(x) for x in idx.locations(idx.lookup(pk(*ids), with_locations=True)[2])]


def hits(idx: Index, *ids: int) -> int:
    return idx.lookup(pk(*ids))[0]


def present(idx: Index, *ids: int) -> list[bool]:
    return idx.lookup(pk(*ids), per_key=True)[1]


def row_of(idx: Index, key: bytes) -> int:
    """The table row of ``key`` (-1: not in the index)."""
    return int(idx.table.find(words(key))[0])


def where(idx: Index, i: int) -> Location:
    """The replica of key ``i`` that readers get (its row's primary), spelled out."""
    row = row_of(idx, k(i))
    assert row >= 0, f"key {i} is not in the index"
    return idx.locations([row])[0]


def places(idx: Index, r: PutStartResult) -> list[Location]:
    """A put's placements, spelled out."""
    return idx.locations(r.placements)


def live_rows(idx: Index) -> np.ndarray:
    t = idx.table
    return np.flatnonzero(t.flags[: t.n_rows] & LIVE)


def live_keys(idx: Index) -> list[bytes]:
    """The keys of every block in the index (committed or pending)."""
    return [idx.table.key(r) for r in live_rows(idx).tolist()]


def status_of(idx: Index, key: bytes) -> bool | None:
    """True: committed; False: pending; None: not in the index."""
    row = row_of(idx, key)
    return None if row < 0 else bool(idx.table.flags[row] & READY)


def lru(idx: Index, s: Segment) -> list[bytes]:
    """The keys of the evictable blocks with a replica in segment ``s``, least recently used
    first: the segment's eviction candidates in recency order."""
    t = idx.table
    rows = live_rows(idx)
    rows = rows[t.evictable(rows) & t.on_segment(rows, s.ref)]
    rows = rows[np.argsort(t.recent[rows], kind="stable")]
    return [t.key(r) for r in rows.tolist()]


def replicas(idx: Index) -> set[tuple[int, int, int]]:
    """(segment id, offset, generation) of every replica the index holds (pending ones too)."""
    t = idx.table
    out = set()
    for r in live_rows(idx).tolist():
        out.add((idx.segments[int(t.seg[r])].spec.segment_id, int(t.off[r]), int(t.gen[r])))
        for i in t.copies.of(r):
            out.add((idx.segments[int(t.copies.seg[i])].spec.segment_id, int(t.copies.off[i]), int(t.copies.gen[i])))
    return out


def snapshot(idx: Index, counters: bool = True):
    """Everything observable about the index's state, for 'nothing changed' checks."""
    t = idx.table
    segs = {}
    for did, d in idx.daemons.items():
        segs[did] = (
            d.deadline,
            {
                sid: (
                    s.alloc.used,
                    sorted(s.alloc._by_start.items()),
                    lru(idx, s),
                    s.blocks,
                    s.pinned,
                    s.leased,
                    s.quarantined,
                )
                for sid, s in d.segments.items()
            },
        )
    blocks = {
        t.key(r): (
            int(t.seg[r]),
            int(t.flags[r]),
            int(t.off[r]),
            int(t.size[r]),
            int(t.length[r]),
            int(t.leases[r]),
            int(t.csum[r]),
            int(t.gen[r]),
            [
                (int(t.copies.seg[i]), int(t.copies.off[i]), int(t.copies.size[i]), int(t.copies.gen[i]))
                for i in t.copies.of(r)
            ],
        )
        for r in live_rows(idx).tolist()
    }
    puts = {
        pid: (p.deadline, p.keys, [t.key(r) for r in p.rows.tolist()], p.gens.tolist()) for pid, p in idx.puts.items()
    }
    leases = {lid: (lease.deadline, lease.rows.tolist(), lease.gens.tolist()) for lid, lease in idx.leases.items()}
    tombstones = {did: list(ts) for did, ts in idx.tombstones.items()}
    return segs, blocks, puts, leases, tombstones, (dict(idx.counters) if counters else None)


# ---- registration -------------------------------------------------------------------------------


def test_register_daemon_creates_empty_segments():
    idx, clock = make(slots=8)
    d = idx.daemons["d1"]
    assert d.deadline == clock.now() + idx.limits.daemon_ttl_s
    s = seg(idx)
    assert s.alloc.capacity == 8 * ALIGN and s.alloc.used == 0
    assert s.blocks == 0 and not lru(idx, s)
    assert len(idx) == 0


@pytest.mark.parametrize(
    ("spec", "inventory", "match"),
    [
        (DaemonSpec("", "h", "a", "b", (SegmentSpec(1, Tier.DRAM, ALIGN),)), {}, "daemon_id"),
        (
            DaemonSpec("d2", "h", "a", "b", (SegmentSpec(1, Tier.DRAM, ALIGN), SegmentSpec(1, Tier.SSD, ALIGN))),
            {},
            "duplicate segment",
        ),
        (DaemonSpec("d2", "h", "a", "b", (SegmentSpec(1, Tier.DRAM, 0),)), {}, "capacity"),
        (DaemonSpec("d2", "h", "a", "b", (SegmentSpec(1, Tier.DRAM, -ALIGN),)), {}, "capacity"),
        pytest.param(
            DaemonSpec("d2", "h", "a", "b", (SegmentSpec(1, Tier.DRAM, ALIGN),)),
            {7: [InventoryItem(k(9), 0, BLK, 1, gen=1)]},
            "unknown segment 7",
        ),
        (DaemonSpec("d2", "h", "a", "b", (SegmentSpec(1, Tier.GPU, ALIGN),)), {}, "tier 3 cannot hold blocks"),
        # Re-registration of an existing daemon with a bad spec must not drop what it held.
        (DaemonSpec("d1", "h", "a", "b", (SegmentSpec(1, Tier.DRAM, 0),)), {}, "capacity"),
    ],
)
def test_register_daemon_bad_input_changes_nothing(spec, inventory, match):
    idx, _ = make()
    put(idx, 0, 1)
    before = snapshot(idx)
    with pytest.raises(InvalidArgument, match=match):
        idx.register_daemon(spec, inventory)
    assert snapshot(idx) == before
    assert hits(idx, 0, 1) == 2
    idx.check_integrity()


# ---- two-phase writes ---------------------------------------------------------------------------


def test_put_start_allocates_and_commit_makes_visible():
    idx, clock = make(slots=8)
    r = idx.put_start(pk(0, 1, 2), [BLK, 10, 2 * BLK])
    assert r.status == [ALLOCATED] * 3
    assert r.deadline == idx.limits.put_timeout_s
    assert r.put_id in idx.puts
    assert len(r.placements) == 3
    offs = [p.offset for p in places(idx, r)]
    sizes = [extent_size(n) for n in (BLK, 10, 2 * BLK)]
    spans = sorted(zip(offs, sizes, strict=True))
    for (a, sa), (b, _) in itertools.pairwise(spans):
        assert a + sa <= b, "placements overlap"
    for p, length in zip(map(L, places(idx, r)), (BLK, 10, 2 * BLK), strict=True):
        assert p.daemon_id == "d1"
        assert p.segment_id == SEG
        assert p.length == length
        assert p.tier == Tier.DRAM
        assert p.offset % ALIGN == 0
    assert seg(idx).alloc.used == sum(sizes)
    # Every placement has its own generation, carried in its 40-byte location row.
    gens = [p.gen for p in places(idx, r)]
    assert len(set(gens)) == 3 and all(g > 0 for g in gens)
    assert ROW.size == 40 and [ROW.unpack(p.row)[-1] for p in places(idx, r)] == gens
    packed = idx.location_rows(r.placements)
    assert [ROW.unpack_from(packed, i * ROW.size)[-1] for i in range(3)] == gens
    idx.check_integrity()
    # Pending: invisible to every reader.
    assert hits(idx, 0, 1, 2) == 0
    assert present(idx, 0, 1, 2) == [False, False, False]
    assert idx.acquire(pk(0)).lease_id == 0
    idx.check_integrity()

    assert idx.put_commit(r.put_id, [11, 12, 13]) == 3
    assert r.put_id not in idx.puts
    n, exists, _ = idx.lookup(pk(0, 1, 2), per_key=True)
    assert n == 3 and exists == [True, True, True]
    locs = locs_of(idx, 0, 1, 2)
    assert [(loc.offset, loc.length, loc.checksum) for loc in locs] == list(
        zip(offs, (BLK, 10, 2 * BLK), (11, 12, 13), strict=True)
    )
    found = idx.lookup(pk(0, 1, 2), with_locations=True)[2]
    rows = [ROW.unpack(x.row) for x in idx.locations(found)]
    assert [(row[2], row[4], row[5]) for row in rows] == list(zip(offs, (11, 12, 13), gens, strict=True))
    packed = idx.location_rows(found)
    assert [ROW.unpack_from(packed, i * ROW.size) for i in range(3)] == rows
    idx.check_integrity()


def test_lookup_is_a_leading_run():
    idx, _ = make()
    put(idx, 0, 1, 3)
    n, exists, _ = idx.lookup(pk(0, 1, 2, 3), per_key=True)
    assert n == 2
    assert exists == [True, True, False, True]
    assert len(locs_of(idx, 0, 1, 2, 3)) == 2
    assert hits(idx, 2, 0, 1) == 0
    assert idx.lookup(pk(0, 1))[1] == []  # per_key off: no per-key list
    idx.check_integrity()


def test_dedup_skip_exists_and_skip_inflight():
    idx, _ = make(slots=8)
    put(idx, 0, 1)
    pending = idx.put_start(pk(2), [BLK])
    used = seg(idx).alloc.used
    r = idx.put_start(pk(0, 1, 2, 3), [BLK] * 4)
    assert r.status == [SKIP_EXISTS, SKIP_EXISTS, SKIP_INFLIGHT, ALLOCATED]
    assert len(r.placements) == 1
    assert seg(idx).alloc.used == used + ALIGN  # only the new block took space
    assert idx.counters["dedup_keys"] == 3
    idx.check_integrity()
    # Committing the second put commits only its own block; the in-flight one stays pending.
    assert idx.put_commit(r.put_id, [7]) == 1
    assert present(idx, 0, 1, 2, 3) == [True, True, False, True]
    assert idx.put_commit(pending.put_id, [5]) == 1
    assert hits(idx, 0, 1, 2, 3) == 4
    idx.check_integrity()


def test_put_of_only_existing_keys_reserves_nothing():
    idx, _ = make(slots=4)
    put(idx, 0, 1)
    before_used = seg(idx).alloc.used
    r = idx.put_start(pk(0, 1), [BLK, BLK])
    assert r.status == [SKIP_EXISTS, SKIP_EXISTS]
    assert len(r.placements) == 0
    assert r.put_id not in idx.puts
    assert seg(idx).alloc.used == before_used
    idx.check_integrity()


def test_commit_with_written_flags_frees_unwritten_blocks():
    idx, clock = make(slots=8)
    r = idx.put_start(pk(0, 1, 2), [BLK] * 3)
    assert idx.put_commit(r.put_id, [1, 2, 3], written=[True, True, False]) == 2
    assert present(idx, 0, 1, 2) == [True, True, False]
    assert 2 not in [i for i in range(3) if present(idx, i)[0]]
    # The unwritten block's extent is freed once the put's write tickets lapse.
    assert seg(idx).alloc.used == 3 * ALIGN and seg(idx).quarantined == ALIGN
    idx.check_integrity()
    clock.advance(idx.limits.put_timeout_s + idx.limits.write_ticket_grace_s + 0.1)
    idx.heartbeat("d1")
    idx.expire()
    assert seg(idx).alloc.used == 2 * ALIGN and seg(idx).quarantined == 0
    idx.check_integrity()
    # The unwritten key can be put again.
    assert put(idx, 2) == [ALLOCATED]
    assert hits(idx, 0, 1, 2) == 3


def test_commit_begin_end_failed_outcomes_are_released_and_never_visible():
    idx, _ = make(slots=8)
    r = idx.put_start(pk(0, 1, 2, 3), [BLK] * 4)
    placed = places(idx, r)
    pc = idx.put_commit_begin(r.put_id, [10, 11, 12, 13], written=[True, True, True, False])
    assert r.put_id not in idx.puts  # out of the reservation table: its deadline no longer applies
    assert pc.status == [CommitStatus.OK] * 3 + [CommitStatus.NOT_WRITTEN]
    assert hits(idx, 0) == 0  # nothing is visible before the daemons answer
    # The unwritten block is released at once, its extent held until its write tickets lapse.
    assert seg(idx).alloc.used == 4 * ALIGN and seg(idx).quarantined == ALIGN
    idx.check_integrity()
    n, status = idx.put_commit_end(pc, {1: (CommitStatus.MISMATCH, 0), 2: (CommitStatus.NO_SPACE, 0)})
    assert n == 1
    assert status == [CommitStatus.OK, CommitStatus.MISMATCH, CommitStatus.NO_SPACE, CommitStatus.NOT_WRITTEN]
    assert present(idx, 0, 1, 2, 3) == [True, False, False, False]
    assert locs_of(idx, 0)[0].checksum == 10
    assert seg(idx).alloc.used == 4 * ALIGN and seg(idx).quarantined == 3 * ALIGN
    assert idx.counters["commit_failed_keys"] == 2
    idx.check_integrity()
    # The daemon may have sealed a block whose commit failed: those leave tombstones, the
    # never-written one does not.
    assert sorted(t.gen for t in idx.take_tombstones()["d1"]) == sorted(p.gen for p in placed[1:3])
    assert put(idx, 1, 2, 3) == [ALLOCATED] * 3


def test_commit_end_stored_size_shrinks_the_extent():
    idx, _ = make(slots=16)
    size = 3 * ALIGN - HEADER_SIZE  # three slots each
    r = idx.put_start(pk(0, 1, 2), [size] * 3)
    pc = idx.put_commit_begin(r.put_id, [1, 2, 3])
    outcome = {0: (CommitStatus.OK, ALIGN), 1: (CommitStatus.OK, ALIGN + 1)}  # 1: not aligned, ignored
    assert idx.put_commit_end(pc, outcome) == (3, [CommitStatus.OK] * 3)
    assert [x.size for x in places(idx, r)] == [ALIGN, 3 * ALIGN, 3 * ALIGN]
    assert [loc.length for loc in locs_of(idx, 0, 1, 2)] == [size] * 3  # the payload is the same
    assert seg(idx).alloc.used == 7 * ALIGN
    idx.check_integrity()
    # The given-back tail is free for other blocks; a removal frees only the shrunk extent.
    assert put(idx, *range(10, 19)) == [ALLOCATED] * 9
    assert hits(idx, 0, 1, 2) == 3
    assert seg(idx).alloc.free == 0
    assert idx.remove(pk(0)) == 1
    assert seg(idx).alloc.free == ALIGN
    idx.check_integrity()


@pytest.mark.parametrize("how", ["lost", "restarted"])
def test_commit_end_after_the_daemon_dropped_is_unavailable(how):
    idx, clock = make(slots=8, daemon_ttl_s=3.0)
    r = idx.put_start(pk(0, 1), [BLK] * 2)
    pc = idx.put_commit_begin(r.put_id, [1, 2])
    if how == "lost":
        clock.advance(3.5)
        assert idx.expire()["daemons"] == 1
    else:
        # It restarted after committing block 0 (its inventory says so), before block 1.
        p0 = places(idx, r)[0]
        assert idx.register_daemon(dspec(), {SEG: [InventoryItem(k(0), p0.offset, BLK, 1, gen=p0.gen)]}) == 0
    n, status = idx.put_commit_end(pc)
    assert n == 0 and status == [CommitStatus.UNAVAILABLE] * 2
    assert present(idx, 0, 1) == [how == "restarted", False]
    assert idx.counters["put_keys"] == 0 and idx.tombstones == {}
    idx.check_integrity()


def test_commit_twice_is_expired_and_abort_after_commit_not_found():
    idx, _ = make()
    r = idx.put_start(pk(0), [BLK])
    idx.put_commit(r.put_id, [1])
    with pytest.raises(Expired):
        idx.put_commit(r.put_id, [1])
    with pytest.raises(NotFound):
        idx.put_abort(r.put_id)
    assert hits(idx, 0) == 1
    idx.check_integrity()


def test_abort_frees_reservation():
    idx, clock = make(slots=4)
    r = idx.put_start(pk(0, 1), [BLK, BLK])
    assert seg(idx).alloc.used == 2 * ALIGN
    assert idx.put_abort(r.put_id) == 2
    # Held back until the put's write tickets lapse, then free.
    assert seg(idx).alloc.used == 2 * ALIGN and seg(idx).quarantined == 2 * ALIGN
    assert seg(idx).blocks == 0
    idx.check_integrity()
    clock.advance(idx.limits.put_timeout_s + idx.limits.write_ticket_grace_s + 0.1)
    idx.heartbeat("d1")
    idx.expire()
    assert seg(idx).alloc.used == 0 and seg(idx).quarantined == 0
    assert len(idx) == 0
    assert hits(idx, 0) == 0
    with pytest.raises(Expired):
        idx.put_commit(r.put_id, [1, 2])
    with pytest.raises(NotFound):
        idx.put_abort(r.put_id)
    idx.check_integrity()
    assert put(idx, 0, 1) == [ALLOCATED, ALLOCATED]


def test_put_ids_and_lease_ids_are_unique():
    idx, _ = make(slots=64)
    ids = {idx.put_start(pk(i), [BLK]).put_id for i in range(20)}
    assert len(ids) == 20
    for pid in ids:
        idx.put_commit(pid, [0])
    leases = {idx.acquire(pk(i)).lease_id for i in range(20)}
    assert len(leases) == 20 and 0 not in leases
    idx.check_integrity()


def test_put_start_with_no_daemon_is_unavailable():
    idx = Index(IndexLimits(), FakeClock())
    with pytest.raises(Unavailable, match="no live daemon"):
        idx.put_start(pk(0), [BLK])
    assert len(idx) == 0 and idx.puts == {}


def test_put_start_partial_no_space_keeps_chain_order():
    idx, _ = make(slots=4)
    put(idx, 0, 1)
    idx.pin(pk(0, 1))
    r = idx.put_start(pk(10, 11, 12, 13), [BLK] * 4)
    assert r.status == [ALLOCATED, ALLOCATED, NO_SPACE, NO_SPACE]
    assert len(r.placements) == 2
    assert idx.counters["no_space_keys"] == 2
    with pytest.raises(InvalidArgument, match="checksums"):
        idx.put_commit(r.put_id, [1, 2, 3, 4])
    assert idx.put_commit(r.put_id, [1, 2]) == 2
    assert hits(idx, 10, 11, 12, 13) == 2
    idx.check_integrity()


def test_no_space_after_a_gap_is_not_filled_by_a_smaller_later_block():
    idx, _ = make(slots=4)
    put(idx, 0, 1)
    idx.pin(pk(0, 1))
    # Two free slots: 10 takes one, 11 needs two, 12 would fit the last one but follows a gap.
    r = idx.put_start(pk(10, 11, 12), [BLK, 2 * BLK, BLK])
    assert r.status == [ALLOCATED, NO_SPACE, NO_SPACE]
    assert seg(idx).alloc.free == ALIGN
    idx.check_integrity()


# ---- placement ----------------------------------------------------------------------------------


def test_placement_prefers_same_host_then_most_free():
    clock = FakeClock()
    idx = Index(IndexLimits(), clock)
    idx.register_daemon(dspec("a", slots=4, host="ha"), {})
    idx.register_daemon(dspec("b", slots=8, host="hb"), {})
    r = idx.put_start(pk(0), [BLK], host_id="ha")
    assert L(places(idx, r)[0]).daemon_id == "a"
    r2 = idx.put_start(pk(1), [BLK], host_id="elsewhere")
    assert L(places(idx, r2)[0]).daemon_id == "b"  # the one with more free space
    r3 = idx.put_start(pk(2), [BLK], host_id="ha", exclude=["a"])
    assert L(places(idx, r3)[0]).daemon_id == "b"
    with pytest.raises(Unavailable, match="excluded: a, b"):
        idx.put_start(pk(3), [BLK], exclude=["a", "b"])
    idx.check_integrity()


def test_placement_prefers_dram_and_falls_back_to_ssd():
    clock = FakeClock()
    idx = Index(IndexLimits(), clock)
    spec = DaemonSpec("d", "h", "x", "y", (SegmentSpec(5, Tier.SSD, 64 * 4096),))
    idx.register_daemon(spec, {})
    r = idx.put_start(pk(0), [BLK])
    assert L(places(idx, r)[0]).tier == Tier.SSD and L(places(idx, r)[0]).offset % 4096 == 0
    idx.put_abort(r.put_id)
    idx.register_daemon(dspec("d", slots=2, extra=(SegmentSpec(5, Tier.SSD, 64 * ALIGN),)), {})
    r = idx.put_start(pk(0), [BLK])
    assert L(places(idx, r)[0]).segment_id == SEG and L(places(idx, r)[0]).tier == Tier.DRAM
    idx.check_integrity()


# ---- lookups have no side effects; acquire/release touch ---------------------------------------


def _fill_one_by_one(idx: Index, ids) -> None:
    for i in ids:
        assert put(idx, i) == [ALLOCATED]


def test_lookup_does_not_change_eviction_order():
    idx, _ = make(slots=4)
    _fill_one_by_one(idx, [0, 1, 2, 3])
    lru_before = lru(idx, seg(idx))
    for _ in range(5):
        assert hits(idx, 0) == 1
        idx.lookup(pk(0, 1, 2, 3), per_key=True)
    assert lru(idx, seg(idx)) == lru_before
    put(idx, 4)
    assert present(idx, 0, 1, 2, 3, 4) == [False, True, True, True, True]  # 0 was still the oldest
    idx.check_integrity()


def test_acquire_release_touches_so_the_next_oldest_is_evicted():
    idx, _ = make(slots=4)
    _fill_one_by_one(idx, [0, 1, 2, 3])
    a = idx.acquire(pk(0))
    idx.release(a.lease_id)
    put(idx, 4)
    assert present(idx, 0, 1, 2, 3, 4) == [True, False, True, True, True]
    idx.check_integrity()


def test_put_of_existing_keys_touches_them():
    idx, _ = make(slots=4)
    _fill_one_by_one(idx, [0, 1, 2, 3])
    assert put(idx, 0) == [SKIP_EXISTS]
    put(idx, 4)
    assert present(idx, 0, 1) == [True, False]
    idx.check_integrity()


# ---- leases -------------------------------------------------------------------------------------


def test_acquire_returns_leading_run_and_locations():
    idx, clock = make()
    put(idx, 0, 1, 2)
    a = idx.acquire(pk(0, 1, 5, 2), ttl_s=4)
    assert a.hit_count == 2 and a.lease_id != 0 and a.ttl == 4
    assert [L(loc).checksum for loc in idx.locations(a.locations)] == [1000, 1001]
    assert idx.leases[a.lease_id].deadline == clock.now() + 4
    assert seg(idx).leased == 2
    idx.check_integrity()
    miss = idx.acquire(pk(7, 0))
    assert miss.hit_count == 0 and miss.lease_id == 0 and len(miss.locations) == 0
    assert len(idx.leases) == 1
    default = idx.acquire(pk(0))
    assert default.ttl == idx.limits.lease_ttl_s
    idx.release(a.lease_id)
    idx.release(default.lease_id)
    assert seg(idx).leased == 0
    with pytest.raises(NotFound):
        idx.release(a.lease_id)
    idx.check_integrity()


def test_leases_prevent_eviction():
    idx, _ = make(slots=4)
    _fill_one_by_one(idx, [0, 1, 2, 3])
    lease = idx.acquire(pk(0, 1))
    assert lease.hit_count == 2
    put(idx, 4)
    put(idx, 5)
    assert present(idx, 0, 1, 2, 3, 4, 5) == [True, True, False, False, True, True]
    idx.check_integrity()
    # Now make the rest unevictable too: one pinned, one in flight.
    assert idx.pin(pk(4)) == 1
    assert idx.remove(pk(5)) == 1
    pending = idx.put_start(pk(5), [BLK])
    assert pending.status == [ALLOCATED]
    idx.check_integrity()
    before = snapshot(idx, counters=False)
    with pytest.raises(ResourceExhausted, match="leased, pinned or being written"):
        idx.put_start(pk(6), [BLK])
    with pytest.raises(ResourceExhausted):
        idx.put_start(pk(6, 7), [BLK, BLK])
    assert snapshot(idx, counters=False) == before
    idx.check_integrity()
    # Releasing the lease makes its blocks evictable again, tail (1) before head (0).
    idx.release(lease.lease_id)
    put(idx, 6)
    assert present(idx, 0, 1, 6) == [True, False, True]
    put(idx, 7)
    assert present(idx, 0, 7) == [False, True]
    assert present(idx, 4) == [True]  # still pinned
    idx.check_integrity()


def test_same_key_leased_twice_needs_both_releases():
    idx, _ = make(slots=2)
    put(idx, 0)
    a = idx.acquire(pk(0))
    b = idx.acquire(pk(0))
    assert seg(idx).leased == 1
    idx.release(a.lease_id)
    put(idx, 1)
    assert lru(idx, seg(idx)) == [k(1)]  # 0 is still leased by b
    idx.check_integrity()
    put(idx, 2)  # must evict 1, not the leased 0
    assert present(idx, 0, 1, 2) == [True, False, True]
    idx.release(b.lease_id)
    assert k(0) in lru(idx, seg(idx))
    idx.check_integrity()


def test_lease_expires_with_clock():
    idx, clock = make(slots=2)
    put(idx, 0, 1)
    a = idx.acquire(pk(0, 1), ttl_s=2.0)
    clock.advance(1.5)
    assert idx.expire() == {"daemons": 0, "puts": 0, "leases": 0, "engines": 0}
    idx.heartbeat("d1")
    clock.advance(1.0)
    out = idx.expire()
    assert out["leases"] == 1
    assert idx.counters["expired_leases"] == 1
    assert a.lease_id not in idx.leases
    with pytest.raises(NotFound):
        idx.release(a.lease_id)
    assert seg(idx).leased == 0
    idx.check_integrity()
    put(idx, 2)  # the expired lease no longer protects: one of them is evicted (the tail)
    assert present(idx, 0, 1, 2) == [True, False, True]
    idx.check_integrity()


def test_release_with_corrupt_index_drops_that_replica():
    idx, _ = make(slots=8)
    put(idx, 0, 1, 2, 3)
    a = idx.acquire(pk(0, 1, 2, 3))
    rep2 = idx.locations(a.locations)[2]
    assert idx.take_tombstones() == {}
    idx.release(a.lease_id, corrupt=[2])
    assert hits(idx, 0, 1, 2, 3) == 2
    assert present(idx, 0, 1, 2, 3) == [True, True, False, True]
    assert seg(idx).alloc.used == 3 * ALIGN
    assert idx.counters["corrupt_reported"] == 1
    assert idx.take_tombstones() == {"d1": [Tombstone(SEG, k(2), rep2.offset, rep2.gen)]}
    idx.check_integrity()


def test_corrupt_report_on_replica_still_leased_elsewhere_frees_after_last_lease():
    idx, _ = make(slots=4)
    put(idx, 0, 1)
    a = idx.acquire(pk(0, 1))
    b = idx.acquire(pk(0))
    idx.release(a.lease_id, corrupt=[0, 0])  # repeated index counts once
    assert idx.counters["corrupt_reported"] == 1
    assert hits(idx, 0) == 0
    assert seg(idx).alloc.used == 2 * ALIGN  # b still reads it
    idx.check_integrity()
    idx.release(b.lease_id, corrupt=[0])  # already dropped: not counted again
    assert idx.counters["corrupt_reported"] == 1
    assert seg(idx).alloc.used == ALIGN
    idx.check_integrity()


@pytest.mark.parametrize("corrupt", [[2], [-1], [0, 5]])
def test_release_corrupt_index_out_of_range_changes_nothing(corrupt):
    idx, _ = make()
    put(idx, 0, 1)
    a = idx.acquire(pk(0, 1))
    before = snapshot(idx)
    with pytest.raises(InvalidArgument, match="corrupt index"):
        idx.release(a.lease_id, corrupt=corrupt)
    assert snapshot(idx) == before
    idx.release(a.lease_id)  # still held: can be released properly
    assert hits(idx, 0, 1) == 2
    idx.check_integrity()


def test_release_unknown_lease_is_not_found():
    idx, _ = make()
    before = snapshot(idx)
    with pytest.raises(NotFound):
        idx.release(12345)
    with pytest.raises(NotFound):
        idx.release(0)
    assert snapshot(idx) == before


# ---- pin ----------------------------------------------------------------------------------------


def test_pinned_keys_survive_eviction_and_unpin_makes_them_evictable():
    idx, _ = make(slots=4)
    _fill_one_by_one(idx, [0, 1, 2, 3])
    assert idx.pin(pk(0, 42)) == 1  # missing key not counted
    assert idx.pin(pk(0)) == 0  # already pinned
    assert seg(idx).pinned == 1
    for i in range(4, 10):
        put(idx, i)
        assert present(idx, 0) == [True]
    idx.check_integrity()
    assert idx.pin(pk(0), pinned=False) == 1
    assert idx.pin(pk(0), pinned=False) == 0
    assert seg(idx).pinned == 0
    for i in range(10, 14):
        put(idx, i)
    assert present(idx, 0) == [False]
    idx.check_integrity()


def test_pin_of_pending_key_is_ignored():
    idx, _ = make()
    r = idx.put_start(pk(0), [BLK])
    assert idx.pin(pk(0)) == 0
    idx.put_commit(r.put_id, [1])
    assert idx.pin(pk(0)) == 1
    idx.check_integrity()


def test_pinned_and_leased_key_stays_unevictable_after_release():
    idx, _ = make(slots=2)
    put(idx, 0)
    a = idx.acquire(pk(0))
    idx.pin(pk(0))
    idx.release(a.lease_id)
    assert k(0) not in lru(idx, seg(idx))
    put(idx, 1)
    put(idx, 2)
    assert present(idx, 0) == [True]
    # Unpin while leased: evictable only once the lease ends.
    b = idx.acquire(pk(0))
    idx.pin(pk(0), pinned=False)
    assert k(0) not in lru(idx, seg(idx))
    idx.release(b.lease_id)
    assert k(0) in lru(idx, seg(idx))
    idx.check_integrity()


def test_remove_of_pinned_key():
    idx, _ = make()
    put(idx, 0)
    idx.pin(pk(0))
    assert idx.remove(pk(0)) == 1
    assert seg(idx).pinned == 0
    assert seg(idx).alloc.used == 0
    idx.check_integrity()


# ---- chains -------------------------------------------------------------------------------------


def test_chain_tail_is_evicted_before_head_after_a_get():
    idx, _ = make(slots=6)
    put(idx, 0, 1, 2, 3)
    put(idx, 10)
    put(idx, 11)
    a = idx.acquire(pk(0, 1, 2, 3))
    assert a.hit_count == 4
    idx.release(a.lease_id)
    seen = []
    for i in range(20, 26):
        put(idx, i)
        ex = present(idx, 0, 1, 2, 3)
        n = hits(idx, 0, 1, 2, 3)
        assert ex == [True] * n + [False] * (4 - n), f"hole in the chain: {ex}"
        seen.append(n)
        idx.check_integrity()
    # 10 and 11 go first (older), then the chain from its tail.
    assert seen == [4, 4, 3, 2, 1, 0]


def test_chain_tail_is_evicted_before_head_after_commit():
    idx, _ = make(slots=4)
    put(idx, 0, 1, 2, 3)
    counts = []
    for i in range(10, 14):
        put(idx, i)
        counts.append(hits(idx, 0, 1, 2, 3))
        assert present(idx, 0, 1, 2, 3) == [True] * counts[-1] + [False] * (4 - counts[-1])
    assert counts == [3, 2, 1, 0]
    idx.check_integrity()


def test_put_start_does_not_evict_a_skip_exists_key_of_the_same_batch():
    idx, _ = make(slots=4)
    _fill_one_by_one(idx, [0, 1, 2, 3])  # 0 is the least recently used
    r = idx.put_start(pk(0, 10), [BLK, BLK])
    assert r.status == [SKIP_EXISTS, ALLOCATED]
    idx.put_commit(r.put_id, [1])
    idx.check_integrity()
    # The caller was told 0 exists and wrote only 10; the chain [0, 10] must now be whole.
    assert hits(idx, 0, 10) == 2


# ---- remove -------------------------------------------------------------------------------------


def test_remove_frees_and_leaves_a_tombstone_taken_once():
    idx, _ = make(slots=4)
    put(idx, 0, 1)
    rep0 = where(idx, 0)
    assert idx.remove(pk(0, 7)) == 1
    assert idx.remove(pk(0)) == 0
    assert present(idx, 0, 1) == [False, True]
    assert seg(idx).alloc.used == ALIGN
    assert idx.counters["removed"] == 1
    assert idx.heartbeat("d1") is True
    assert idx.take_tombstones(["d1"]) == {"d1": [Tombstone(SEG, k(0), rep0.offset, rep0.gen)]}
    assert idx.take_tombstones(["d1"]) == {} and idx.tombstones == {}
    assert idx.counters["tombstones"] == 1
    idx.check_integrity()


def test_remove_of_pending_key_is_ignored():
    idx, _ = make()
    r = idx.put_start(pk(0), [BLK])
    assert idx.remove(pk(0)) == 0
    assert idx.put_commit(r.put_id, [1]) == 1
    assert hits(idx, 0) == 1
    idx.check_integrity()


def test_remove_of_leased_key_is_invisible_at_once_and_freed_after_release():
    idx, _ = make(slots=2)
    put(idx, 0)
    a = idx.acquire(pk(0))
    off = idx.locations(a.locations)[0].offset
    assert idx.remove(pk(0)) == 1
    assert hits(idx, 0) == 0
    assert idx.acquire(pk(0)).lease_id == 0
    assert seg(idx).alloc.used == ALIGN  # the reader is still copying
    idx.check_integrity()
    # The key can be put again at once, but never over the leased extent.
    r = idx.put_start(pk(0), [BLK])
    assert r.status == [ALLOCATED] and places(idx, r)[0].offset != off
    idx.put_commit(r.put_id, [9])
    assert seg(idx).alloc.used == 2 * ALIGN
    assert idx.pin(pk(0)) == 1
    with pytest.raises(ResourceExhausted):  # the old extent is neither free nor evictable
        idx.put_start(pk(1), [BLK])
    idx.check_integrity()
    idx.release(a.lease_id)
    assert seg(idx).alloc.used == ALIGN
    assert hits(idx, 0) == 1 and locs_of(idx, 0)[0].checksum == 9
    idx.check_integrity()


# ---- writer crash / deadlines -------------------------------------------------------------------


def test_writer_crash_reclaimed_at_deadline():
    idx, clock = make(slots=4)
    r = idx.put_start(pk(0, 1, 2), [BLK] * 3, timeout_s=5.0)
    assert r.deadline == 5.0
    assert seg(idx).alloc.used == 3 * ALIGN
    clock.advance(4.9)
    idx.heartbeat("d1")
    assert idx.expire()["puts"] == 0
    assert r.put_id in idx.puts
    clock.advance(0.2)
    idx.heartbeat("d1")
    assert idx.expire() == {"daemons": 0, "puts": 1, "leases": 0, "engines": 0}
    assert idx.counters["expired_puts"] == 1
    assert len(idx) == 0 and idx.puts == {}
    assert seg(idx).alloc.used == 3 * ALIGN  # held back until the put's write tickets lapse
    assert seg(idx).blocks == 0
    assert hits(idx, 0) == 0
    idx.check_integrity()
    clock.advance(idx.limits.write_ticket_grace_s)
    idx.heartbeat("d1")
    idx.expire()
    assert seg(idx).alloc.used == 0
    idx.check_integrity()
    with pytest.raises(Expired):
        idx.put_commit(r.put_id, [1, 2, 3])
    with pytest.raises(NotFound):
        idx.put_abort(r.put_id)
    # The keys are free for another writer.
    assert put(idx, 0, 1, 2, 3) == [ALLOCATED] * 4


def test_default_put_timeout_applies():
    idx, clock = make(put_timeout_s=2.0)
    r = idx.put_start(pk(0), [BLK])
    assert r.deadline == 2.0
    clock.advance(2.5)
    idx.heartbeat("d1")
    assert idx.expire()["puts"] == 1
    idx.check_integrity()


# ---- daemons: liveness, re-registration, invalidations ------------------------------------------


def test_daemon_without_heartbeat_is_dropped_with_its_replicas():
    idx, clock = make(slots=8, daemon_ttl_s=3.0)
    put(idx, 0, 1, 2)
    idx.pin(pk(1))
    a = idx.acquire(pk(0))
    pending = idx.put_start(pk(5), [BLK])
    clock.advance(3.5)
    out = idx.expire()
    assert out["daemons"] == 1
    assert idx.counters["daemons_lost"] == 1
    assert "d1" not in idx.daemons
    assert hits(idx, 0) == 0 and hits(idx, 1) == 0 and hits(idx, 5) == 0
    assert len(idx) == 0
    assert idx.heartbeat("d1") is False
    idx.check_integrity()
    # Stale handles of the lost daemon are harmless.
    idx.release(a.lease_id)
    assert idx.put_commit(pending.put_id, [1]) == 0
    idx.check_integrity()
    # Its blocks were forgotten, not freed: a restarted daemon's inventory is the truth, so no tombstone.
    assert idx.tombstones == {}
    with pytest.raises(Unavailable):
        idx.put_start(pk(9), [BLK])


def test_heartbeat_keeps_daemon_alive():
    idx, clock = make(daemon_ttl_s=3.0)
    put(idx, 0)
    for _ in range(10):
        clock.advance(2.0)
        assert idx.heartbeat("d1") is True
        assert idx.expire()["daemons"] == 0
    assert idx.daemons["d1"].deadline == clock.now() + 3.0
    assert hits(idx, 0) == 1
    idx.check_integrity()


def test_one_daemon_lost_others_keep_serving():
    clock = FakeClock()
    idx = Index(IndexLimits(daemon_ttl_s=3.0), clock)
    idx.register_daemon(dspec("a", slots=4), {})
    idx.register_daemon(dspec("b", slots=4), {})
    ra = idx.put_start(pk(0), [BLK], exclude=["b"])
    rb = idx.put_start(pk(1), [BLK], exclude=["a"])
    idx.put_commit(ra.put_id, [1])
    idx.put_commit(rb.put_id, [2])
    clock.advance(2.0)
    idx.heartbeat("b")
    clock.advance(2.0)
    assert idx.expire()["daemons"] == 1
    assert present(idx, 0, 1) == [False, True]
    idx.check_integrity()
    # Writers land on the survivor.
    r = idx.put_start(pk(0), [BLK])
    assert L(places(idx, r)[0]).daemon_id == "b"
    idx.check_integrity()


def _inventory(items, gen0: int = 1):
    """A DRAM inventory of (key id, offset, length) items; their generations count up from ``gen0``."""
    return {SEG: [InventoryItem(k(i), off, length, 500 + i, gen=gen0 + n) for n, (i, off, length) in enumerate(items)]}


def test_reregistration_with_inventory_rebuilds_entries_and_allocator():
    idx, clock = make(slots=16)
    put(idx, 0, 1)  # forgotten: the daemon's word wins
    items = [(10, 0, BLK), (11, ALIGN, 3 * BLK), (12, 4 * ALIGN, 10), (13, 9 * ALIGN, 0)]
    assert idx.register_daemon(dspec(slots=16), _inventory(items)) == 0
    assert hits(idx, 0) == 0
    assert hits(idx, 10, 11, 12, 13) == 4
    locs = locs_of(idx, 10, 11, 12, 13)
    assert [(loc.offset, loc.length, loc.checksum) for loc in locs] == [
        (0, BLK, 510),
        (ALIGN, 3 * BLK, 511),
        (4 * ALIGN, 10, 512),
        (9 * ALIGN, 0, 513),
    ]
    assert seg(idx).alloc.used == sum(extent_size(n) for _, _, n in items)
    assert seg(idx).blocks == 4
    idx.check_integrity()
    # New writes go to the gaps only.
    idx.pin(pk(10, 11, 12, 13))  # so that no inventory block is evicted to make room
    taken = {(off, off + extent_size(n)) for _, off, n in items}
    for i in range(20, 40):
        try:
            r = idx.put_start(pk(i), [BLK])
        except ResourceExhausted:
            break
        off = places(idx, r)[0].offset
        for lo, hi in taken:
            assert off + ALIGN <= lo or hi <= off, "new extent overlaps an inventory extent"
        idx.put_commit(r.put_id, [0])
        idx.pin(pk(i))
        taken.add((off, off + ALIGN))
    # All gaps were filled: 16 slots minus the 1 + 3 + 1 + 1 the inventory holds.
    assert len(taken) == 4 + 10
    assert seg(idx).alloc.free == 0
    idx.check_integrity()


def test_inventory_is_adopted_oldest_first_into_lru():
    idx, _ = make(slots=3)
    idx.register_daemon(dspec(slots=3), _inventory([(5, 2 * ALIGN, BLK), (6, 0, BLK), (7, ALIGN, BLK)]))
    put(idx, 8)
    assert present(idx, 5, 6, 7, 8) == [False, True, True, True]
    idx.check_integrity()


def test_reregistration_rejects_bad_inventory_items():
    clock = FakeClock()
    idx = Index(IndexLimits(), clock)
    idx.register_daemon(dspec("other", slots=4), _inventory([(99, 0, BLK)]))
    inv = _inventory(
        [
            (0, 0, BLK),
            (1, 0, BLK),  # overlaps 0
            (2, ALIGN, 2 * BLK),  # [A, 3A)
            (3, 2 * ALIGN, BLK),  # overlaps 2
            (4, 3 * ALIGN + 8, BLK),  # misaligned
            (5, 7 * ALIGN, 2 * BLK),  # runs past the end
            (99, 4 * ALIGN, BLK),  # key held by another daemon
            (0, 5 * ALIGN, BLK),  # key repeated in this inventory
            (6, 6 * ALIGN, BLK),
        ]
    )
    inv[SEG].append(InventoryItem(b"short", 3 * ALIGN, BLK, 1, gen=50))  # wrong key length
    inv[SEG].append(InventoryItem(k(7), 3 * ALIGN, BLK, 1))  # no generation (gen 0)
    rejected = idx.register_daemon(dspec("d", slots=8), inv)
    assert rejected == 8
    assert present(idx, 0, 2, 6, 99) == [True, True, True, True]
    assert present(idx, 1, 3, 4, 5, 7) == [False] * 5
    assert locs_of(idx, 99)[0].daemon_id == "other"
    assert locs_of(idx, 0)[0].offset == 0
    assert seg(idx, "d").alloc.used == ALIGN + 2 * ALIGN + ALIGN
    assert seg(idx, "d").blocks == 3
    idx.check_integrity()


def test_reregistration_resets_liveness_and_drops_pending_puts():
    idx, clock = make(daemon_ttl_s=3.0)
    pending = idx.put_start(pk(0), [BLK])
    clock.advance(2.5)
    idx.register_daemon(dspec(), {})
    assert len(idx) == 0
    clock.advance(2.5)
    assert idx.expire()["daemons"] == 0  # re-registration counts as a heartbeat
    assert idx.put_commit(pending.put_id, [1]) == 0
    assert hits(idx, 0) == 0
    idx.check_integrity()


def test_reregistration_with_a_leased_replica():
    idx, _ = make(slots=4)
    put(idx, 0)
    a = idx.acquire(pk(0))
    (old,) = idx.locations(a.locations)
    off, gen = old.offset, old.gen
    # The daemon restarted and still holds the block at the same place.
    idx.register_daemon(dspec(slots=4), _inventory([(0, off, BLK)], gen0=gen))
    assert hits(idx, 0) == 1 and where(idx, 0).gen == gen
    idx.check_integrity()
    idx.release(a.lease_id, corrupt=[0])  # the old replica is gone: the adopted one stays
    assert hits(idx, 0) == 1
    assert seg(idx).alloc.used == ALIGN
    idx.check_integrity()


def test_unknown_daemon_heartbeat():
    idx, _ = make()
    assert idx.heartbeat("nobody") is False


# ---- tombstones ---------------------------------------------------------------------------------


def test_tombstones_for_evicted_blocks_taken_once():
    idx, _ = make(slots=2)
    put(idx, 0)
    put(idx, 1)
    reps = [where(idx, i) for i in (0, 1)]
    put(idx, 2)
    put(idx, 3)
    assert idx.counters["evictions"] == 2
    assert idx.counters["evicted_bytes"] == 2 * BLK
    want = [Tombstone(SEG, k(i), r.offset, r.gen) for i, r in enumerate(reps)]
    assert idx.take_tombstones() == {"d1": want}
    assert idx.take_tombstones() == {}
    # The newer blocks reuse the extents under other generations: a late tombstone cannot hit them.
    new = {(r.offset, r.gen) for r in (where(idx, 2), where(idx, 3))}
    assert {o for o, _ in new} == {t.offset for t in want}
    assert not new & {(t.offset, t.gen) for t in want}
    idx.check_integrity()


def test_pending_replicas_leave_no_tombstone():
    idx, clock = make(slots=8, put_timeout_s=2.0)
    idx.put_abort(idx.put_start(pk(0, 1), [BLK] * 2).put_id)
    r = idx.put_start(pk(2, 3), [BLK] * 2)
    assert idx.put_commit(r.put_id, [1, 2], written=[True, False]) == 1
    idx.put_start(pk(4), [BLK])
    clock.advance(3.0)
    idx.heartbeat("d1")
    assert idx.expire()["puts"] == 1
    assert present(idx, 0, 1, 2, 3, 4) == [False, False, True, False, False]
    assert idx.tombstones == {} and idx.counters["tombstones"] == 0
    idx.check_integrity()


def test_undelivered_tombstones_come_back_and_outlive_the_daemons_loss():
    idx, clock = make(slots=4, daemon_ttl_s=3.0)
    put(idx, 0, 1, 2)
    reps = {i: where(idx, i) for i in (0, 1, 2)}
    t0, t1 = (Tombstone(SEG, k(i), reps[i].offset, reps[i].gen) for i in (0, 1))
    idx.remove(pk(0))
    taken = idx.take_tombstones()
    assert taken == {"d1": [t0]}
    idx.remove(pk(1))
    idx.return_tombstones("d1", taken["d1"])  # the daemon could not be told
    assert idx.tombstones == {"d1": [t0, t1]}  # returned ones go out first
    clock.advance(3.5)
    assert idx.expire()["daemons"] == 1
    assert idx.take_tombstones() == {}  # only for known daemons...
    assert idx.tombstones == {"d1": [t0, t1]}  # ...the lost one's are kept for its return
    # It comes back still holding all three blocks: the tombstoned ones stay dropped.
    inv = {SEG: [InventoryItem(k(i), r.offset, r.length, r.checksum, gen=r.gen) for i, r in reps.items()]}
    assert idx.register_daemon(dspec(slots=4), inv) == 2
    assert present(idx, 0, 1, 2) == [False, False, True]
    assert seg(idx).alloc.used == ALIGN
    assert idx.take_tombstones() == {"d1": [t0, t1]}
    idx.check_integrity()


def test_register_daemon_rejects_a_tombstoned_item_and_adopts_another_generation():
    idx, _ = make(slots=4)
    put(idx, 0)
    r = where(idx, 0)
    assert r.offset == 0
    idx.remove(pk(0))  # its tombstone is not delivered yet
    item = InventoryItem(k(0), r.offset, BLK, 1000, gen=r.gen)
    assert idx.register_daemon(dspec(slots=4), {SEG: [item]}) == 1
    assert hits(idx, 0) == 0 and seg(idx).alloc.used == 0
    # A tombstone of another segment does not match.
    other = dspec(slots=4, extra=(SegmentSpec(SEG + 1, Tier.SSD, 4 * SSD_ALIGN),))
    assert idx.register_daemon(other, {SEG + 1: [item]}) == 0
    # The same key at the same offset under another generation is a newer write: adopted.
    newer = 1 << 62  # above any clock-drawn generation
    assert idx.register_daemon(dspec(slots=4), {SEG: [item._replace(gen=newer)]}) == 0
    assert hits(idx, 0) == 1 and where(idx, 0).gen == newer
    assert idx.take_tombstones() == {"d1": [Tombstone(SEG, k(0), r.offset, r.gen)]}
    # Generations drawn later are above every adopted one.
    assert places(idx, idx.put_start(pk(1), [BLK]))[0].gen > newer
    idx.check_integrity()


def test_removing_an_adopted_inventory_block_leaves_a_tombstone():
    idx, _ = make(slots=4)
    assert idx.register_daemon(dspec(slots=4), _inventory([(0, 0, BLK), (1, ALIGN, BLK)], gen0=7)) == 0
    assert idx.remove(pk(0)) == 1
    put(idx, 2, 3, 4, 5)  # evicts 1 to place 5
    assert idx.take_tombstones() == {"d1": [Tombstone(SEG, k(0), 0, 7), Tombstone(SEG, k(1), ALIGN, 8)]}


def test_demotion_frees_the_dram_source_with_a_tombstone():
    idx = Index(IndexLimits(), FakeClock())
    idx.register_daemon(dspec(slots=4, extra=(SegmentSpec(SEG + 1, Tier.SSD, 8 * SSD_ALIGN),)), {})
    put(idx, 0, 1, 2, 3)  # DRAM full, above its high watermark; 3 (the chain's tail) is coldest
    src = where(idx, 3)
    (mv,) = idx.plan_moves()["d1"]
    assert mv.demote and mv.src == src and mv.row == row_of(idx, k(3)) and mv.dst.gen != src.gen
    assert idx.tombstones == {}
    idx.finish_move(mv.move_id, True)
    assert L(where(idx, 3)).tier == Tier.SSD and hits(idx, 0, 1, 2, 3) == 4
    assert idx.take_tombstones() == {"d1": [Tombstone(SEG, k(3), src.offset, src.gen)]}
    idx.check_integrity()


def test_a_demoted_source_a_reader_holds_is_tombstoned_at_once_and_its_extent_kept_until_the_lease():
    # A reader leased the DRAM copy while it was being demoted. Its daemon is told to forget it
    # at once (a tombstone held back for the lease would be lost with a restart of the service,
    # and the copy adopted again from the daemon's inventory); the extent is not reused until
    # the lease ends. A TCP reader that finds it gone asks the index again (kvstore.client.reads).
    clock = FakeClock()
    idx = Index(IndexLimits(), clock)
    idx.register_daemon(dspec(slots=4, extra=(SegmentSpec(SEG + 1, Tier.SSD, 8 * SSD_ALIGN),)), {})
    put(idx, 0, 1, 2, 3)
    (mv,) = idx.plan_moves()["d1"]
    src = mv.src
    a = idx.acquire(pk(0, 1, 2, 3))
    assert a.locations[3] == mv.row and idx.locations(a.locations)[3] == src
    idx.finish_move(mv.move_id, True)
    assert L(where(idx, 3)).tier == Tier.SSD
    assert idx.take_tombstones() == {"d1": [Tombstone(SEG, k(3), src.offset, src.gen)]}
    used = seg(idx).alloc.used
    assert seg(idx).quarantined == src.size
    idx.release(a.lease_id)
    assert idx.take_tombstones() == {}
    # The lease follows its row to SSD, so the DRAM extent is held until the last lease on the
    # block can have ended (its deadline), not until its release (kvstore/meta/tiers.py).
    assert seg(idx).alloc.used == used
    idx.check_integrity()
    clock.advance(idx.limits.lease_ttl_s + 0.1)
    idx.heartbeat("d1")
    idx.expire()
    assert seg(idx).alloc.used == used - src.size and seg(idx).quarantined == 0
    idx.check_integrity()


def test_removing_the_source_of_a_move_in_flight_keeps_its_extent_until_the_move_ends():
    idx = Index(IndexLimits(), FakeClock())
    idx.register_daemon(dspec(slots=4, extra=(SegmentSpec(SEG + 1, Tier.SSD, 8 * SSD_ALIGN),)), {})
    put(idx, 0, 1, 2, 3)
    (mv,) = idx.plan_moves()["d1"]
    used = seg(idx).alloc.used
    assert idx.remove(pk(3)) == 1  # the block goes while the daemon is copying it
    assert seg(idx).alloc.used == used  # the source extent is still being read: kept
    idx.check_integrity()  # accounting holds between handlers, with the move in flight
    idx.finish_move(mv.move_id, True)
    assert seg(idx).alloc.used == used - mv.src.size and hits(idx, 3) == 0
    idx.check_integrity()


def test_plan_moves_skips_daemons_with_a_batch_under_way_and_keeps_their_promotions():
    idx = Index(IndexLimits(), FakeClock())
    ssd = (SegmentSpec(SEG + 1, Tier.SSD, 8 * SSD_ALIGN),)
    idx.register_daemon(dspec("d1", slots=4, extra=ssd), {})
    assert idx.plan_moves(skip={"d1"}) == {}
    put(idx, 0, 1, 2, 3)  # DRAM full, above its high watermark
    assert idx.plan_moves(skip={"d1"}) == {} and not idx.moves  # skipped: nothing planned or leased
    (mv,) = idx.plan_moves()["d1"]
    idx.finish_move(mv.move_id, True)
    row = row_of(idx, k(3))
    idx.promote_queue[row] = where(idx, 3).gen  # read from SSD: to be promoted
    assert idx.plan_moves(skip={"d1"}) == {} and row in idx.promote_queue  # kept for later
    idx.check_integrity()


# ---- bad input: typed error naming the problem, nothing changed --------------------------------


def _bad_calls():
    big = IndexLimits().max_block_bytes
    return [
        ("put_start", lambda idx: idx.put_start(k(0)[:15], [BLK]), "multiple of 16"),
        ("put_start", lambda idx: idx.put_start(k(0) + b"x", [BLK]), "multiple of 16"),
        ("put_start", lambda idx: idx.put_start(b"", []), "empty batch"),
        ("put_start", lambda idx: idx.put_start(pk(*range(5)), [BLK] * 5), "over the limit of 4"),
        ("put_start", lambda idx: idx.put_start(pk(20, 21), [BLK]), "1 sizes for 2 keys"),
        ("put_start", lambda idx: idx.put_start(pk(20), [BLK, BLK]), "2 sizes for 1 keys"),
        ("put_start", lambda idx: idx.put_start(pk(20, 21), [BLK, 0]), r"sizes\[1\]"),
        ("put_start", lambda idx: idx.put_start(pk(20), [-5]), r"sizes\[0\]"),
        ("put_start", lambda idx: idx.put_start(pk(20), [big + 1]), r"sizes\[0\]"),
        ("put_start", lambda idx: idx.put_start(pk(20, 21), [BLK, 8 * ALIGN]), "larger than any segment"),
        ("put_start", lambda idx: idx.put_start(pk(20, 21, 20), [BLK] * 3), "repeat a key"),
        ("put_start", lambda idx: idx.put_start(pk(20), [BLK], timeout_s=-1), "put timeout must not be negative"),
        ("put_start", lambda idx: idx.put_start(pk(20), [BLK], timeout_s=601), "put timeout .* over the limit"),
        ("put_start", lambda idx: idx.put_start(pk(20), [BLK], timeout_s=math.inf), "over the limit"),
        ("lookup", lambda idx: idx.lookup(b"\0" * 17), "multiple of 16"),
        ("lookup", lambda idx: idx.lookup(b""), "empty batch"),
        ("lookup", lambda idx: idx.lookup(pk(*range(5))), "over the limit"),
        ("acquire", lambda idx: idx.acquire(b"\0" * 8), "multiple of 16"),
        ("acquire", lambda idx: idx.acquire(b""), "empty batch"),
        ("acquire", lambda idx: idx.acquire(pk(0), ttl_s=-0.5), "lease ttl must not be negative"),
        ("acquire", lambda idx: idx.acquire(pk(0), ttl_s=301), "lease ttl .* over the limit"),
        ("remove", lambda idx: idx.remove(b""), "empty batch"),
        ("remove", lambda idx: idx.remove(pk(*range(5))), "over the limit"),
        ("pin", lambda idx: idx.pin(b"\1" * 20), "multiple of 16"),
        ("pin", lambda idx: idx.pin(b"", pinned=False), "empty batch"),
    ]


@pytest.mark.parametrize(("call", "match"), [(c, m) for _, c, m in _bad_calls()], ids=[n for n, _, _ in _bad_calls()])
def test_bad_input_is_invalid_argument_and_changes_nothing(call, match):
    idx, _ = make(slots=8, max_batch_keys=4)
    put(idx, 0, 1)
    a = idx.acquire(pk(0))
    idx.put_start(pk(2), [BLK])
    before = snapshot(idx)
    with pytest.raises(InvalidArgument, match=match):
        call(idx)
    assert snapshot(idx) == before
    assert a.lease_id in idx.leases
    idx.check_integrity()


def test_largest_block_that_fits_a_segment_is_accepted():
    idx, _ = make(slots=8)
    r = idx.put_start(pk(0), [8 * ALIGN - HEADER_SIZE])
    assert r.status == [ALLOCATED]
    assert seg(idx).alloc.free == 0
    idx.check_integrity()


def test_max_batch_keys_exactly_is_accepted():
    idx, _ = make(slots=8, max_batch_keys=4)
    assert put(idx, 0, 1, 2, 3) == [ALLOCATED] * 4
    assert hits(idx, 0, 1, 2, 3) == 4


def test_timeout_at_the_limit_is_accepted():
    idx, _ = make()
    assert idx.put_start(pk(0), [BLK], timeout_s=idx.limits.max_put_timeout_s).deadline == 600.0
    idx.put_commit(next(iter(idx.puts)), [0])
    assert idx.acquire(pk(0), ttl_s=idx.limits.max_lease_ttl_s).ttl == 300.0


@pytest.mark.parametrize(
    ("n_checksums", "written"),
    [(1, None), (3, None), (0, None), (2, [True]), (2, [True, True, False])],
)
def test_put_commit_with_wrong_counts_changes_nothing(n_checksums, written):
    idx, _ = make()
    r = idx.put_start(pk(0, 1), [BLK, BLK])
    before = snapshot(idx)
    with pytest.raises(InvalidArgument, match="checksums" if written is None else "written"):
        idx.put_commit(r.put_id, list(range(n_checksums)), written=written)
    assert snapshot(idx) == before
    assert idx.put_commit(r.put_id, [1, 2]) == 2
    idx.check_integrity()


def test_put_abort_unknown_is_not_found():
    idx, _ = make()
    with pytest.raises(NotFound):
        idx.put_abort(424242)


def test_nan_put_timeout_refused():
    idx, _ = make()
    with pytest.raises(InvalidArgument, match="timeout"):
        idx.put_start(pk(0), [BLK], timeout_s=math.nan)


def test_nan_lease_ttl_refused():
    idx, _ = make()
    put(idx, 0)
    with pytest.raises(InvalidArgument, match="ttl"):
        idx.acquire(pk(0), ttl_s=math.nan)


# ---- check_integrity itself ----------------------------------------------------------------------


def test_check_integrity_catches_broken_accounting():
    idx, _ = make()
    put(idx, 0, 1)
    idx.table.leases[row_of(idx, k(0))] += 1  # an evictable block kept from eviction by no lease
    with pytest.raises(AssertionError):
        idx.check_integrity()
    idx2, _ = make()
    put(idx2, 0)
    seg(idx2).alloc.alloc(ALIGN)  # space used by nothing
    with pytest.raises(AssertionError):
        idx2.check_integrity()


# ---- randomized soak ----------------------------------------------------------------------------


class Model:
    """What the test expects, independently of the index's internals."""

    def __init__(self) -> None:
        self.puts: dict[int, tuple[float, list[tuple[bytes, str]]]] = {}  # put id -> deadline, (key, daemon)
        self.lost: set[tuple[int, bytes]] = set()  # (put id, key) whose daemon re-registered meanwhile
        self.leases: dict[int, tuple[float, list[bytes], dict[bytes, bool]]] = {}  # id -> deadline, run, valid
        self.pinned: set[bytes] = set()

    def forget_key(self, key: bytes) -> None:
        self.pinned.discard(key)
        for _, _, valid in self.leases.values():
            if key in valid:
                valid[key] = False


def _check_model(idx: Index, m: Model) -> None:
    idx.check_integrity()
    assert set(idx.puts) == set(m.puts)
    assert set(idx.leases) == set(m.leases)
    t = idx.table
    for key in m.pinned:
        row = row_of(idx, key)
        assert row >= 0 and t.flags[row] & READY and t.flags[row] & PINNED, "a pinned block disappeared"
    for _, _, valid in m.leases.values():
        for key, ok in valid.items():
            if ok:
                assert status_of(idx, key) is True, "a leased block disappeared"
    for pid, (_, items) in m.puts.items():
        for key, _ in items:
            if (pid, key) not in m.lost:
                row = row_of(idx, key)
                assert status_of(idx, key) is False and row in idx.puts[pid].rows, "a pending block disappeared"


@pytest.mark.parametrize("seed", [1, 2])
def test_randomized_soak(seed):
    rng = random.Random(seed)
    clock = FakeClock()
    # A short write-ticket grace: the small segments would mostly hold ended puts' extents.
    limits = IndexLimits(
        put_timeout_s=4.0, lease_ttl_s=3.0, daemon_ttl_s=1e6, max_batch_keys=64, write_ticket_grace_s=2
    )
    idx = Index(limits, clock)
    specs = {"d1": dspec("d1", slots=10, host="h1"), "d2": dspec("d2", slots=6, host="h2")}
    for s in specs.values():
        idx.register_daemon(s, {})
    chains = [[k(c * 100 + j) for j in range(6)] for c in range(6)]
    m = Model()
    stats = dict.fromkeys(("alloc", "skip", "nospace", "exhausted", "commit", "expired_put", "evict"), 0)

    def pick_keys() -> list[bytes]:
        chain = rng.choice(chains)
        lo = 0 if rng.random() < 0.7 else rng.randrange(len(chain))
        hi = rng.randrange(lo + 1, len(chain) + 1)
        return chain[lo:hi]

    for _step in range(2000):
        op = rng.choices(
            ["put", "commit", "abort", "acquire", "release", "remove", "pin", "unpin", "tick", "restart"],
            weights=[30, 20, 4, 14, 10, 4, 4, 3, 10, 1],
        )[0]
        if op == "put":
            keys = pick_keys()
            before = {key: status_of(idx, key) for key in keys}
            evictions = idx.counters["evictions"]
            sizes = [rng.choice([1, BLK, BLK, BLK + 1, 2 * BLK, 500]) for _ in keys]
            timeout = rng.choice([0.0, 1.0, 2.0, 6.0])
            try:
                r = idx.put_start(b"".join(keys), sizes, host_id=rng.choice(["h1", "h2", ""]), timeout_s=timeout)
            except ResourceExhausted:
                stats["exhausted"] += 1
                for d in idx.daemons.values():
                    for s in d.segments.values():
                        # The request's own stored keys are held out of eviction during its put.
                        others = [k for k in lru(idx, s) if k not in keys]
                        assert not others, "ResourceExhausted while something was still evictable"
            else:
                gap = False
                placed = []
                for key, st in zip(keys, r.status, strict=True):
                    if before[key] is True:
                        # SKIP_EXISTS, unless this very call evicted it to place an earlier key.
                        assert st == SKIP_EXISTS or idx.counters["evictions"] > evictions
                        gap = gap or st == NO_SPACE
                    elif before[key] is False:
                        assert st == SKIP_INFLIGHT
                    elif gap:
                        assert st == NO_SPACE
                    else:
                        assert st in (ALLOCATED, NO_SPACE)
                        gap = st == NO_SPACE
                    if st == ALLOCATED:
                        placed.append(key)
                stats["alloc"] += len(placed)
                stats["skip"] += sum(1 for v in before.values() if v is not None)
                stats["nospace"] += r.status.count(NO_SPACE)
                assert len(r.placements) == len(placed)
                if placed:
                    m.puts[r.put_id] = (
                        clock.now() + (timeout or idx.limits.put_timeout_s),
                        [(key, L(p).daemon_id) for key, p in zip(placed, places(idx, r), strict=True)],
                    )
                else:
                    assert r.put_id not in idx.puts
        elif op in ("commit", "abort") and m.puts:
            pid = rng.choice(sorted(m.puts))
            _, items = m.puts.pop(pid)
            alive = [key for key, _ in items if (pid, key) not in m.lost]
            if op == "commit":
                written = [rng.random() < 0.9 for _ in items] if rng.random() < 0.3 else None
                n = idx.put_commit(pid, [rng.getrandbits(64) for _ in items], written=written)
                ok = [
                    key
                    for i, (key, _) in enumerate(items)
                    if (pid, key) not in m.lost and (written is None or written[i])
                ]
                assert n == len(ok)
                if ok:
                    assert all(present(idx, *[int.from_bytes(x, "big") - 1 for x in ok]))
                stats["commit"] += n
            else:
                assert idx.put_abort(pid) == len(alive)
                for key in alive:
                    assert status_of(idx, key) is None
        elif op == "acquire":
            keys = pick_keys()
            expect = idx.lookup(b"".join(keys))[0]
            ttl = rng.choice([0.0, 0.5, 2.0])
            a = idx.acquire(b"".join(keys), ttl_s=ttl)
            assert a.hit_count == expect
            if a.hit_count:
                run = keys[: a.hit_count]
                m.leases[a.lease_id] = (clock.now() + (ttl or idx.limits.lease_ttl_s), run, dict.fromkeys(run, True))
            else:
                assert a.lease_id == 0
        elif op == "release" and m.leases:
            lid = rng.choice(sorted(m.leases))
            _, run, valid = m.leases.pop(lid)
            corrupt = [i for i in range(len(run)) if rng.random() < 0.1]
            idx.release(lid, corrupt=corrupt)
            for i in corrupt:
                if valid[run[i]]:
                    assert status_of(idx, run[i]) is None, "a corrupt replica is still served"
                    m.forget_key(run[i])
        elif op == "remove":
            keys = pick_keys()
            expect = sum(1 for key in keys if status_of(idx, key) is True)
            assert idx.remove(b"".join(keys)) == expect
            for key in keys:
                assert status_of(idx, key) is not True
                m.forget_key(key)
        elif op in ("pin", "unpin"):
            keys = pick_keys()
            want = op == "pin"
            complete = [key for key in keys if status_of(idx, key) is True]
            expect = sum(1 for key in complete if (key in m.pinned) != want)
            assert idx.pin(b"".join(keys), pinned=want) == expect
            if want:
                m.pinned.update(complete)
            else:
                m.pinned.difference_update(keys)
        elif op == "tick":
            clock.advance(rng.choice([0.0, 0.3, 1.0, 2.5]))
            for did in specs:
                assert idx.heartbeat(did) is True
            live = replicas(idx)
            for ts in idx.take_tombstones().values():
                stats["evict"] += len(ts)
                # A tombstone names a dropped replica exactly: never one the index still holds.
                assert not live & {(t.segment_id, t.offset, t.gen) for t in ts}
            now = clock.now()
            exp_puts = [pid for pid, (dl, _) in m.puts.items() if dl < now]
            exp_leases = [lid for lid, (dl, _, _) in m.leases.items() if dl < now]
            out = idx.expire()
            assert out == {"daemons": 0, "puts": len(exp_puts), "leases": len(exp_leases), "engines": 0}
            for pid in exp_puts:
                _, items = m.puts.pop(pid)
                for key, _ in items:
                    if (pid, key) not in m.lost:
                        assert status_of(idx, key) is None
                with pytest.raises(Expired):
                    idx.put_commit(pid, [0] * len(items))
                stats["expired_put"] += 1
            for lid in exp_leases:
                del m.leases[lid]
        elif op == "restart":
            # d2 restarts: re-registers with what it holds (its complete blocks), losing pins,
            # leases and reservations; the blocks themselves stay served.
            s2 = seg(idx, "d2")
            t = idx.table
            rows = live_rows(idx)
            reps = idx.locations(rows[(t.seg[rows] == s2.ref) & ((t.flags[rows] & READY) != 0)])
            held = [r.key for r in reps]
            inv = {SEG: [InventoryItem(r.key, r.offset, r.length, r.checksum, gen=r.gen) for r in reps]}
            for pid, (_, items) in m.puts.items():
                for key, did in items:
                    if did == "d2":
                        m.lost.add((pid, key))
            for key in held:
                m.forget_key(key)
            assert idx.register_daemon(specs["d2"], inv) == 0
            assert all(status_of(idx, key) is True for key in held)
        _check_model(idx, m)

    # Every kind of event actually happened.
    assert stats["alloc"] > 100 and stats["skip"] > 100 and stats["commit"] > 50
    assert stats["nospace"] + stats["exhausted"] > 0
    assert stats["expired_put"] > 0 and stats["evict"] > 0
    # Drain: release all leases, abort all puts, remove everything: all space comes back.
    for lid in list(m.leases):
        idx.release(lid)
    for pid in list(m.puts):
        idx.put_abort(pid)
    idx.pin(b"".join(key for c in chains for key in c), pinned=False)
    idx.remove(b"".join(key for c in chains for key in c))
    idx.check_integrity()
    assert len(idx) == 0
    # What ended puts held comes back once their write tickets lapsed.
    clock.advance(max(idx.limits.put_timeout_s, 6.0) + idx.limits.write_ticket_grace_s + 0.1)
    for did in specs:
        idx.heartbeat(did)
    idx.expire()
    idx.check_integrity()
    for did in specs:
        assert seg(idx, did).alloc.used == 0 and seg(idx, did).quarantined == 0
        assert seg(idx, did).blocks == 0


# ---- drain, stall grace, and costs that follow the daemon ---------------------------------------


def test_drain_drops_the_daemon_and_reports_leases_until_released():
    idx, clock = make(slots=8)
    put(idx, 1, 2, 3)
    r = idx.acquire(pk(1, 2), ttl_s=5.0)
    blocks, held, wait = idx.drain_daemon("d1")
    assert (blocks, held) == (3, 1) and 4.9 < wait <= 5.0
    assert "d1" not in idx.daemons and idx.lookup(pk(1, 2, 3))[0] == 0
    assert idx.counters["daemons_drained"] == 1
    # Its blocks leave without tombstones: the daemon keeps them for a warm restart.
    assert not idx.tombstones.get("d1")
    # Asked again (the daemon follows its leases): nothing more is dropped.
    assert idx.drain_daemon("d1")[:2] == (0, 1)
    idx.release(r.lease_id)
    assert idx.drain_daemon("d1") == (0, 0, 0.0)
    idx.check_integrity()
    # A put now goes nowhere: the daemon takes no more puts.
    with pytest.raises(Unavailable):
        idx.put_start(pk(9), [BLK])


def test_grace_keeps_daemons_through_a_stall_of_the_service():
    idx, clock = make()
    put(idx, 1)
    clock.advance(idx.limits.daemon_ttl_s + 1)  # the service stood still this long
    idx.grace(idx.limits.daemon_ttl_s + 1)
    assert idx.expire()["daemons"] == 0 and "d1" in idx.daemons
    clock.advance(idx.limits.daemon_ttl_s + 0.1)  # then no heartbeat for a lease: dropped
    assert idx.expire()["daemons"] == 1


def test_losing_a_daemon_touches_only_its_own_replicas():
    idx, clock = make(slots=64)
    idx.register_daemon(dspec("d2", slots=64, host="h2"), {})
    for i in range(40):
        idx.put_start(pk(i), [BLK], host_id="h1" if i % 2 else "h2")
    for pid in list(idx.puts):
        idx.put_commit(pid, [7])
    pending = idx.put_start(pk(100, 101), [BLK, BLK], host_id="h1")  # reserved on d1, not committed
    assert all(L(p).daemon_id == "d1" for p in places(idx, pending))
    t = idx.table
    rows = live_rows(idx)
    d2_keys = [x.key for x in idx.locations(rows) if L(x).daemon_id == "d2"]
    on_d1 = int((t.seg[rows] == seg(idx, "d1").ref).sum())
    assert on_d1 == 22 and seg(idx, "d1").blocks == 22 and len(d2_keys) == 20
    idx._drop_daemon("d1")
    idx.check_integrity()
    assert sorted(live_keys(idx)) == sorted(d2_keys)
    assert idx.put_commit(pending.put_id, [1, 2]) == 0  # its reservations went with the daemon
    assert idx.lookup(pk(100))[0] == 0


def test_expiry_of_many_leases_pops_only_what_expired():
    idx, clock = make(slots=8)
    put(idx, 1)
    leases = [idx.acquire(pk(1), ttl_s=1.0 + i).lease_id for i in range(5)]
    idx.release(leases[0])  # released early: its heap entry is skipped when it comes up
    clock.advance(3.5)
    assert idx.expire()["leases"] == 2  # ttl 2 and 3 ran out; ttl 1 was released
    assert set(idx.leases) == set(leases[3:])
    clock.advance(10)
    assert idx.expire()["leases"] == 2 and not idx.leases and not idx._lease_deadlines
    idx.check_integrity()


def test_registration_in_steps_takes_no_puts_until_adopted_and_can_be_superseded():
    idx, clock = make(slots=8)  # daemon d1 on host h1
    inv = _inventory([(i, i * ALIGN, BLK) for i in range(5)], gen0=10)
    steps = idx.register_daemon_steps(dspec("d2", slots=8, host="h2"), inv, chunk=2)
    next(steps)  # one step in: the daemon known, its extents reserved, nothing adopted yet
    assert idx.daemons["d2"].adopting and hits(idx, 0) == 0
    next(steps)  # part adopted, the daemon still not placeable
    assert idx.daemons["d2"].adopting and hits(idx, 0, 1, 2) == 2  # a chunk of 2
    r = idx.put_start(pk(50), [BLK], host_id="h2")
    assert L(places(idx, r)[0]).daemon_id == "d1"  # not on the adopting daemon
    assert idx.plan_moves() == {}
    clock.advance(idx.limits.daemon_ttl_s * 0.9)
    idx.heartbeat("d1")
    next(steps)  # its lease is renewed at every step
    clock.advance(idx.limits.daemon_ttl_s * 0.9)
    idx.heartbeat("d1")
    assert idx.expire()["daemons"] == 0 and "d2" in idx.daemons
    with pytest.raises(StopIteration) as done:
        next(steps)
    assert done.value.value == 0 and not idx.daemons["d2"].adopting and hits(idx, 0, 1, 2, 3, 4) == 5
    idx.put_abort(r.put_id)
    idx.check_integrity()
    # A second registration in the middle of the first supersedes it.
    first = idx.register_daemon_steps(
        dspec("d3", slots=8, host="h3"), _inventory([(i, i * ALIGN, BLK) for i in range(10, 15)]), chunk=2
    )
    next(first)
    assert idx.register_daemon(dspec("d3", slots=8, host="h3"), _inventory([(20, 0, BLK)])) == 0
    with pytest.raises(StopIteration):
        next(first)
    assert hits(idx, 20) == 1 and hits(idx, 10) == 0 and hits(idx, 12) == 0
    idx.check_integrity()


def test_bad_registration_in_steps_raises_at_the_first_step_changing_nothing():
    idx, _ = make()
    steps = idx.register_daemon_steps(dspec("d2"), {99: []})
    with pytest.raises(InvalidArgument, match="unknown segment 99"):
        next(steps)
    assert "d2" not in idx.daemons
