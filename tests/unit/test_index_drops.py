"""A lost or drained daemon's blocks leave the index in steps of a bounded number of table rows
(so that a daemon of tens of millions of blocks does not hold the service's event loop), and
none of them is found from the moment it is lost: not by lookups, gets, puts, removes, pins or
a registration of the same daemon again, with the accounting whole between any two steps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvstore.meta import membership
from kvstore.meta.index import Index, IndexLimits, InventoryItem, PutStatus
from tests.unit.test_index import BLK, SEG, FakeClock, dspec, pk

STEP_ROWS = 8


@pytest.fixture(autouse=True)
def _small_steps(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(membership, "DROP_ROWS", STEP_ROWS)


def two_daemons() -> tuple[Index, FakeClock]:
    clock = FakeClock()
    idx = Index(IndexLimits(cache_policy="adaptive"), clock)
    assert idx.register_daemon(dspec("d1", slots=64, host="h1"), {}) == 0
    assert idx.register_daemon(dspec("d2", slots=32, host="h2"), {}) == 0
    return idx, clock


def put_on(idx: Index, host: str, ids: range) -> None:
    r = idx.put_start(pk(*ids), [BLK] * len(ids), host_id=host)
    assert r.status.count(PutStatus.ALLOCATED) == len(ids)
    assert idx.put_commit(r.put_id, [7] * len(ids)) == len(ids)


def lose_d1(idx: Index, clock: FakeClock) -> None:
    clock.advance(idx.limits.daemon_ttl_s / 2)
    idx.heartbeat("d2")
    clock.advance(idx.limits.daemon_ttl_s / 2 + 1)
    idx.heartbeat("d2")
    assert idx.expire(stepwise=True)["daemons"] == 1


def test_a_lost_daemons_blocks_are_never_found_while_they_leave_in_steps():
    idx, clock = two_daemons()
    put_on(idx, "h1", range(40))
    put_on(idx, "h2", range(100, 110))
    lease = idx.acquire(pk(0, 1)).lease_id  # held across the loss
    lose_d1(idx, clock)
    assert "d1" not in idx.daemons and len(idx) == 10
    assert idx._drops, "the drop goes on in steps"
    idx.check_integrity()
    # None of d1's blocks is found, whatever asks.
    assert idx.lookup(pk(5, 6))[0] == 0 and idx.acquire(pk(7)).hit_count == 0
    assert idx.remove(pk(8)) == 0 and idx.pin(pk(9)) == 0 and not idx.is_pinned(pk(9))
    assert idx.touch([pk(10)]) == 0 and idx.tiers(pk(11))[0] == b"\x00"
    assert idx.replicas(pk(12)) == [] and sorted(idx.keys()) == sorted(pk(i) for i in range(100, 110))
    idx.check_integrity()
    # A put of one of them stores it anew (on d2), not "already stored".
    r = idx.put_start(pk(13), [BLK])
    assert r.status == [PutStatus.ALLOCATED]
    assert idx.put_commit(r.put_id, [99]) == 1
    assert idx.lookup(pk(13))[0] == 1 and idx.locations(idx.lookup(pk(13), with_locations=True)[2])[0].checksum == 99
    # d1 comes back and reports one of its old blocks: adopted, not refused as a clash.
    item = InventoryItem(pk(14), 0, BLK, 5, gen=1)
    assert idx.register_daemon(dspec("d1", slots=64, host="h1"), {SEG: [item]}) == 0
    assert idx.lookup(pk(14))[0] == 1
    steps = 0
    while idx.drop_step():
        steps += 1
        idx.check_integrity()
        assert idx.lookup(pk(20, 21))[0] == 0
    assert steps >= math.ceil(40 / STEP_ROWS) - 1  # each step scans at most STEP_ROWS rows
    assert idx._zombies == 0 and not idx._leaving
    idx.release(lease)  # the leased rows go back now
    idx.check_integrity()
    assert len(idx) == 12 and idx.counters["daemons_lost"] == 1


def test_each_step_scans_a_bounded_number_of_rows(monkeypatch):
    idx, clock = two_daemons()
    put_on(idx, "h1", range(50))
    scanned = []
    drop_lost = Index._drop_lost

    def counting(self, rows, seg):  # noqa: ANN001, ANN202
        scanned.append(len(rows))
        return drop_lost(self, rows, seg)

    monkeypatch.setattr(Index, "_drop_lost", counting)
    lose_d1(idx, clock)
    while idx.drop_step():
        pass
    assert sum(scanned) == 50 and max(scanned) <= STEP_ROWS
    idx.check_integrity()


def test_a_drain_in_steps_and_its_daemon_back_at_once():
    idx, _ = two_daemons()
    put_on(idx, "h1", range(30))
    blocks, held, _ = idx.drain_daemon("d1", stepwise=True)
    assert blocks == 30 and held == 0 and len(idx) == 0
    # Registered again before the drop is through: its own registration carries it through.
    assert idx.register_daemon(dspec("d1", slots=64, host="h1"), {}) == 0
    idx.check_integrity()
    while idx.drop_step():
        idx.check_integrity()
    put_on(idx, "h1", range(30))
    assert len(idx) == 30
    idx.check_integrity()


def test_a_registration_in_steps_drops_the_daemons_old_blocks_in_steps():
    idx, _ = two_daemons()
    put_on(idx, "h1", range(40))
    steps = idx.register_daemon_steps(dspec("d1", slots=64, host="h1"), {}, chunk=16)
    n = 0
    for _ in steps:
        n += 1
        idx.check_integrity()
        assert idx.lookup(pk(3))[0] == 0
    assert n >= 40 // STEP_ROWS - 1 and len(idx) == 0 and "d1" in idx.daemons
    idx.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_the_table_unlinks_batches_of_any_size_and_still_finds_the_rest(seed):
    """Batch deletion takes rows out of their probe runs in one pass (the rest of each run is
    placed again): at a fill near the table's limit, with long runs, every row left is found,
    every row taken out is not, and the freed rows come back."""
    from kvstore.meta.table import BlockTable, words

    rnd = np.random.default_rng(seed)
    t = BlockTable(rows=4, seed=seed)
    n = 20_000
    q = words(rnd.integers(0, 2**63, size=2 * n, dtype=np.uint64).tobytes())
    rows = t.add(q)
    alive = np.ones(n, dtype=bool)
    for size in (1, 40, 700, 3000, 6000):
        pick = rnd.choice(np.flatnonzero(alive), size=size, replace=False)
        t.unlink_many(rows[pick])
        t.free_many(rows[pick])
        alive[pick] = False
        found = t.find(q)
        assert (found[~alive] == -1).all() and (found[alive] == rows[alive]).all()
        t.check_integrity()
    back = t.add(q[~alive])
    rows[~alive] = back
    assert (t.find(q) == rows).all()
    t.check_integrity()
