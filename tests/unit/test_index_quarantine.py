"""The index (kvstore.meta.index) holds back the extents of a put that ends
uncommitted until its write tickets can no longer be honoured (kvstore.meta.quarantine): an
aborted, expired or unwritten block's bytes go to no other put before the put's deadline plus
the tickets' grace, on the index clock; the accounting holds throughout; a lost daemon's held
extents go with it."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import tickets
from kvstore.errors import Expired, ResourceExhausted
from kvstore.extent import ALIGN, HEADER_SIZE
from kvstore.meta.index import CommitStatus, DaemonSpec, Index, IndexLimits, SegmentSpec, Tier
from kvstore.meta.records import WRITE_TICKET_GRACE_S, Segment
from tests.unit.test_index import FakeClock

BLK = ALIGN - HEADER_SIZE
TIMEOUT = 5.0


def key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def spec(daemon_id: str = "d1", slots: int = 4) -> DaemonSpec:
    seg = SegmentSpec(1, Tier.DRAM, slots * ALIGN, f"/dev/shm/{daemon_id}")
    return DaemonSpec(daemon_id, f"h-{daemon_id}", f"{daemon_id}:data", f"{daemon_id}:ctl", (seg,))


def setup(slots: int = 4) -> tuple[Index, FakeClock]:
    clock = FakeClock()
    ix = Index(IndexLimits(cache_policy="lru"), clock)
    ix.register_daemon(spec(slots=slots), {})
    return ix, clock


def seg(ix: Index) -> Segment:
    return ix.daemons["d1"].segments[1]


def offsets(ix: Index, placements: np.ndarray) -> list[int]:
    return [x.offset for x in ix.locations(placements)]


def tick(ix: Index, clock: FakeClock, seconds: float) -> None:
    clock.advance(seconds)
    for d in list(ix.daemons):
        ix.heartbeat(d)
    ix.expire()
    ix.check_integrity()


def end_uncommitted(ix: Index, clock: FakeClock, how: str, put_id: int) -> None:
    if how == "abort":
        assert ix.put_abort(put_id) == 1
    elif how == "expire":
        tick(ix, clock, TIMEOUT + 0.1)
        assert put_id not in ix.puts
    elif how == "commit_late":
        clock.advance(TIMEOUT + 0.1)
        with pytest.raises(Expired):
            ix.put_commit(put_id, [1])
    else:  # not written
        assert ix.put_commit(put_id, [1], written=[False]) == 0


def test_the_grace_covers_the_tickets_skew_and_the_rounding_of_their_expiry() -> None:
    # expiry = int(wall + ttl) + 1, honoured SKEW_S longer by a daemon clock up to SKEW_S behind, plus slack
    assert WRITE_TICKET_GRACE_S >= 2 * tickets.SKEW_S + 1 + 1
    assert IndexLimits().write_ticket_grace_s == WRITE_TICKET_GRACE_S


@pytest.mark.parametrize("how", ["abort", "expire", "commit_late", "not_written"])
def test_an_ended_puts_extent_goes_to_no_other_put_until_its_write_tickets_lapse(how: str) -> None:
    ix, clock = setup()
    s = seg(ix)
    p = ix.put_start(key(0), [BLK], timeout_s=TIMEOUT)
    (off,) = offsets(ix, p.placements)
    release_at = clock.now() + TIMEOUT + WRITE_TICKET_GRACE_S
    end_uncommitted(ix, clock, how, p.put_id)
    assert ix.lookup(key(0))[0] == 0 and not ix.puts
    # Held back: still used, not free, no block.
    assert s.quarantined == ALIGN and s.alloc.used == ALIGN and s.alloc.free == 3 * ALIGN and s.blocks == 0
    ix.check_integrity()
    # Until the tickets lapse, puts of the same size get other bytes (and the key again).
    tick(ix, clock, release_at - clock.now() - 0.5)
    q = ix.put_start(key(0), [BLK], timeout_s=TIMEOUT)
    assert q.status == [0] and offsets(ix, q.placements) != [off]
    assert ix.put_commit(q.put_id, [2]) == 1
    assert s.alloc.used == 2 * ALIGN and s.quarantined == ALIGN and s.blocks == 1
    tick(ix, clock, 0.4)
    assert s.quarantined == ALIGN  # not a moment early
    tick(ix, clock, 0.2)  # past the put's deadline plus the grace: free
    assert s.quarantined == 0 and s.alloc.used == ALIGN and s.alloc.free == 3 * ALIGN
    r = ix.put_start(key(1), [BLK])
    assert offsets(ix, r.placements) == [off]
    assert ix.put_commit(r.put_id, [3]) == 1
    assert s.alloc.used == 2 * ALIGN and s.blocks == 2
    ix.check_integrity()


def test_held_extents_are_not_evictable_space() -> None:
    ix, clock = setup(slots=2)
    p = ix.put_start(key(0) + key(1), [BLK, BLK], timeout_s=TIMEOUT)
    assert ix.put_abort(p.put_id) == 2
    # Nothing to evict, nothing free: the segment is full until the tickets lapse.
    with pytest.raises(ResourceExhausted):
        ix.put_start(key(2), [BLK])
    ix.check_integrity()
    tick(ix, clock, TIMEOUT + WRITE_TICKET_GRACE_S + 0.1)
    assert ix.put_start(key(2), [BLK]).status == [0]
    ix.check_integrity()


def test_blocks_whose_commit_the_daemon_refused_are_held_back_too() -> None:
    ix, clock = setup()
    s = seg(ix)
    p = ix.put_start(key(0) + key(1), [BLK, BLK], timeout_s=TIMEOUT)
    pc = ix.put_commit_begin(p.put_id, [1, 2])
    n, status = ix.put_commit_end(pc, {1: (CommitStatus.MISMATCH, 0)})
    assert n == 1 and status == [CommitStatus.OK, CommitStatus.MISMATCH]
    assert s.quarantined == ALIGN and s.alloc.used == 2 * ALIGN and s.blocks == 1
    ix.check_integrity()
    tick(ix, clock, TIMEOUT + WRITE_TICKET_GRACE_S + 0.1)
    assert s.quarantined == 0 and s.alloc.used == ALIGN
    ix.check_integrity()


@pytest.mark.parametrize("how", ["lost", "drained"])
def test_a_lost_daemons_held_extents_go_with_it(how: str) -> None:
    ix, clock = setup()
    p = ix.put_start(key(0) + key(1), [BLK, BLK], timeout_s=TIMEOUT)
    assert ix.put_abort(p.put_id) == 2
    old = seg(ix)
    assert old.quarantined == 2 * ALIGN
    if how == "lost":
        clock.advance(ix.limits.daemon_ttl_s + 0.1)
        assert ix.expire()["daemons"] == 1
    else:
        ix.drain_daemon("d1")
    assert "d1" not in ix.daemons and old.quarantined == 0
    ix.check_integrity()
    # It comes back with its inventory (empty): all its space is free (safe: a daemon makes a
    # new ticket key at every registration, kvstore.daemon.links, so no earlier write ticket
    # serves any more), and what was held for its earlier self is not freed again when its time
    # comes.
    assert ix.register_daemon(spec(), {}) == 0
    assert seg(ix).alloc.used == 0 and seg(ix).quarantined == 0
    r = ix.put_start(key(2) + key(3), [BLK, BLK])
    assert ix.put_commit(r.put_id, [1, 2]) == 2
    tick(ix, clock, TIMEOUT + WRITE_TICKET_GRACE_S + 0.1)
    assert seg(ix).alloc.used == 2 * ALIGN and seg(ix).quarantined == 0
    ix.check_integrity()


def test_many_ended_puts_are_released_in_deadline_order() -> None:
    ix, clock = setup(slots=16)
    s = seg(ix)
    ids = []
    for i in range(8):
        ids.append(ix.put_start(key(i), [BLK], timeout_s=1.0 + i).put_id)
    for pid in reversed(ids):
        ix.put_abort(pid)
    assert s.quarantined == 8 * ALIGN
    tick(ix, clock, 1.0 + WRITE_TICKET_GRACE_S + 0.5)  # only the first put's time passed
    assert s.quarantined == 7 * ALIGN
    tick(ix, clock, 3.0)
    assert s.quarantined == 4 * ALIGN
    tick(ix, clock, 10.0)
    assert s.quarantined == 0 and s.alloc.used == 0 and len(ix._quarantine) == 0
    ix.check_integrity()
