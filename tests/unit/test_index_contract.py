"""The index (kvstore.meta.index) under random operation sequences, checked against a model of
the contract: a hit is a block that was committed and not removed since, with the checksum it
was committed with; a pinned block stays while its daemon does; a put skips exactly the keys
that are stored; statuses, errors and tombstones are consistent; and the accounting holds at
every step (check_integrity), with either cache policy and with the adaptive policy in each of
its modes. Plus the columnar table's own invariants and the index's edge cases."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, KVStoreError, NotFound
from kvstore.extent import ALIGN, HEADER_SIZE
from kvstore.meta.duel import FREQUENCY, RECENCY, SECOND_CHANCE
from kvstore.meta.index import ROW, DaemonSpec, Index, IndexLimits, InventoryItem, PolicyParams, SegmentSpec, Tier
from kvstore.meta.records import PutStatus
from kvstore.meta.table import BlockTable, words
from tests.unit.test_index import FakeClock

BLK = ALIGN - HEADER_SIZE


def key(i: int) -> bytes:
    return random.Random(i).getrandbits(128).to_bytes(16, "little")


def spec(daemon_id: str, slots: int) -> DaemonSpec:
    return DaemonSpec(
        daemon_id, f"h-{daemon_id}", f"{daemon_id}:data", f"{daemon_id}:ctl",
        (SegmentSpec(1, Tier.DRAM, slots * ALIGN, f"/dev/shm/{daemon_id}"),),
    )  # fmt: skip


def csum(k: bytes) -> int:
    return int.from_bytes(k[:8], "little") ^ 0x5A5A


class Model:
    """One index driven by random operations, and what the contract lets it answer."""

    def __init__(self, seed: int, policy: str = "lru", params: PolicyParams | None = None) -> None:
        self.rnd = random.Random(seed)
        self.clock = FakeClock()
        limits = IndexLimits(cache_policy=policy, max_batch_keys=64, policy=params or PolicyParams())
        self.ix = Index(limits, self.clock, rows=16)
        self.mode = RECENCY
        if policy == "adaptive":
            # The mode follows a schedule of this test, not the duel: every mode and every switch
            # between them is driven.
            duel = self.ix.policy.duel
            duel.decide = lambda: setattr(duel, "mode", self.mode)
        self.daemons = {"d1": 12, "d2": 7}
        for d, slots in self.daemons.items():
            assert self.ix.register_daemon(spec(d, slots), {}) == 0
        # Chains over a small universe: a few shared heads, private tails.
        self.chains = [[key(1000 * c + i) for i in range(self.rnd.randint(2, 9))] for c in range(6)]
        # What may be stored: key -> the checksum it was committed with (eviction and daemon loss
        # take blocks away silently; nothing else puts them there).
        self.may: dict[bytes, int] = {}
        self.pinned: set[bytes] = set()  # pinned while stored, since the last daemon loss
        self.puts: list[tuple[int, list[bytes], list[int]]] = []  # (put, allocated keys, checksums)
        self.leases: list[tuple[int, int]] = []
        self.hits = 0

    def chain(self) -> list[bytes]:
        c = self.rnd.choice(self.chains)
        return c[: self.rnd.randint(1, len(c))]

    def lost(self) -> None:
        """A daemon left: its blocks may be gone, pinned or not."""
        self.pinned.clear()

    def drop_steps(self) -> None:
        """A few steps of the lost daemons' drops, maybe not all: what is left of them must
        never be found, whatever comes next (a put of the same keys, the daemon back)."""
        for _ in range(self.rnd.randint(0, 3)):
            self.ix.drop_step()

    def check_lookup(self, keys: list[bytes]) -> None:
        n, exists, rows = self.ix.lookup(b"".join(keys), True, True)
        assert len(rows) == n and exists[:n] == [True] * n and (n == len(keys) or not exists[n])
        for k, e in zip(keys, exists):
            assert not e or k in self.may, "a block never committed, or removed, is found"
            assert e or k not in self.pinned, "a pinned block is gone"
        for k, loc in zip(keys, self.ix.locations(rows)):
            assert loc.key == k and loc.checksum == self.may[k], "a location of another block"
        self.hits += n

    def commit(self, put_id: int, keys: list[bytes], sums: list[int]) -> None:
        rnd, ix = self.rnd, self.ix
        written = [rnd.random() < 0.9 for _ in keys] if rnd.random() < 0.3 else None
        try:
            pc = ix.put_commit_begin(put_id, sums, written)
        except KVStoreError:
            return
        outcome = {}
        for i, loc in enumerate(pc.replicas):
            if loc is None or rnd.random() < 0.6:
                continue
            if rnd.random() < 0.5:
                outcome[i] = (rnd.choice((2, 3, 4)), 0)  # MISMATCH, NO_SPACE, UNAVAILABLE
            elif loc.size > ALIGN:
                outcome[i] = (0, ALIGN)  # stored in fewer bytes: the rest of the extent goes back
        if rnd.random() < 0.1:
            d = rnd.choice(sorted(self.daemons))
            ix._start_drop(d)  # its blocks leave in steps, some of them still to come
            self.drop_steps()
            self.lost()
            assert ix.register_daemon(spec(d, self.daemons[d]), {}) == 0
        n, status = ix.put_commit_end(pc, outcome)
        assert len(status) == len(keys) and status.count(0) == n
        for k, s, c in zip(keys, status, sums):
            if s == 0:
                self.may[k] = c

    def step(self) -> None:
        rnd, ix = self.rnd, self.ix
        if rnd.random() < 0.01:
            self.mode = rnd.choice((RECENCY, SECOND_CHANCE, FREQUENCY))
        op = rnd.random()
        if op < 0.25:
            keys = self.chain()
            sizes = [rnd.choice((BLK, BLK, 2 * ALIGN - HEADER_SIZE)) for _ in keys]
            before = ix.lookup(b"".join(keys), True)[1]
            try:
                r = ix.put_start(b"".join(keys), sizes, rnd.choice(("", "h-d2")))
            except KVStoreError:
                return
            for k, s, was in zip(keys, r.status, before):
                if was:  # stored before: skipped (it may have been evicted for this very put)
                    assert s == PutStatus.SKIP_EXISTS, s
                if s == PutStatus.SKIP_EXISTS:
                    assert k in self.may
            new = [k for k, s in zip(keys, r.status) if s == PutStatus.ALLOCATED]
            assert len(new) == len(r.placements)
            assert [x.key for x in ix.locations(r.placements)] == new
            if new:
                sums = [csum(k) ^ rnd.getrandbits(8) for k in new]  # a put may carry other bytes
                self.puts.append((r.put_id, new, sums))
        elif op < 0.40 and self.puts:
            put_id, keys, sums = self.puts.pop(rnd.randrange(len(self.puts)))
            if rnd.random() < 0.15:
                try:
                    ix.put_abort(put_id)
                except NotFound:  # it expired meanwhile
                    assert put_id not in ix.puts
            else:
                self.commit(put_id, keys, sums)
        elif op < 0.55:
            self.check_lookup(self.chain())
        elif op < 0.68:
            keys = self.chain()
            a = ix.acquire(b"".join(keys))
            for k, loc in zip(keys, ix.locations(a.locations)):
                assert loc.key == k and loc.checksum == self.may[k]
            if a.hit_count:
                self.leases.append((a.lease_id, a.hit_count))
        elif op < 0.80 and self.leases:
            lease_id, n = self.leases.pop(rnd.randrange(len(self.leases)))
            bad = [i for i in range(n) if rnd.random() < 0.05]
            try:
                ix.release(lease_id, bad)
            except NotFound:  # it expired meanwhile
                assert lease_id not in ix.leases
            if bad:
                self.pinned.clear()  # a block reported damaged leaves, pinned or not
        elif op < 0.84:
            k = rnd.choice(self.chain())
            n = ix.remove(k)
            assert n <= 1 and (n == 0 or k in self.may)
            self.may.pop(k, None)
            self.pinned.discard(k)
            assert ix.lookup(k)[0] == 0
        elif op < 0.88:
            keys = self.chain()
            flag = rnd.random() < 0.5
            stored = ix.lookup(b"".join(keys), True)[1]
            ix.pin(b"".join(keys), flag)
            for k, e in zip(keys, stored):
                if flag and e:
                    self.pinned.add(k)
                elif not flag:
                    self.pinned.discard(k)
                assert ix.is_pinned(k) == (flag and e) or not e or not flag
        elif op < 0.91:
            chains = [self.chain() for _ in range(rnd.randint(1, 3))]
            stored = ix.touch([b"".join(c) for c in chains])
            assert stored <= sum(len(c) for c in chains)
        elif op < 0.92:
            keys = self.chain()
            tiers = ix.tiers(b"".join(keys))[0]
            exists = ix.lookup(b"".join(keys), True)[1]
            assert [t != 0 for t in tiers] == exists
            assert set(ix.pin_candidates(b"".join(keys))) <= {k for k, e in zip(keys, exists) if e}
        elif op < 0.925:
            d = rnd.choice(sorted(self.daemons))
            blocks, held, _ = ix.drain_daemon(d, stepwise=self.rnd.random() < 0.5)
            assert blocks >= 0 and held >= 0 and d not in ix.daemons
            self.drop_steps()
            self.lost()
            assert ix.register_daemon(spec(d, self.daemons[d]), {}) == 0
        elif op < 0.97:
            self.clock.advance(rnd.choice((0.5, 2.0, 12.0)))
            for d in self.daemons:
                if rnd.random() < 0.97:
                    ix.heartbeat(d)
            if ix.expire(stepwise=rnd.random() < 0.5)["daemons"]:
                self.lost()
            self.drop_steps()
            for d, slots in self.daemons.items():
                if d not in ix.daemons:  # lost: it comes back empty
                    assert ix.register_daemon(spec(d, slots), {}) == 0
        else:
            for d, items in ix.take_tombstones().items():
                assert d in self.daemons and all(t.gen > 0 for t in items)
        ix.check_integrity()


@pytest.fixture(autouse=True)
def _small_drop_steps(monkeypatch) -> None:  # noqa: ANN001
    """A lost daemon's blocks leave a few table rows per step: drops interleave with the rest."""
    from kvstore.meta import membership

    monkeypatch.setattr(membership, "DROP_ROWS", 3)


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_keep_the_contract_and_the_accounting(seed: int) -> None:
    m = Model(seed)
    for _ in range(1500):
        m.step()
    c = m.ix.counters
    assert c["evictions"] > 0  # the capacity was short: eviction happened under the checks
    assert c["commit_failed_keys"] > 0  # daemons refused blocks in two-phase commits
    assert c["daemons_drained"] > 0 and m.hits > 0


@pytest.mark.parametrize("seed", range(12))
def test_with_the_adaptive_policy_in_every_mode_the_contract_holds(seed: int) -> None:
    # A small floor for the policy's population, so that counts age and the history of blocks
    # not stored is trimmed within the run; the mode changes on a schedule (see Model).
    m = Model(seed, "adaptive", PolicyParams(min_population=4))
    for _ in range(1500):
        m.step()
    pol, c = m.ix.policy, m.ix.counters
    assert c["evictions"] > 0 and c["not_admitted_keys"] > 0
    assert pol.epoch > 2 and all(pol.duel.keys_in)  # counts aged; reads in every mode
    assert m.hits > 0


def test_inventory_adoption_refuses_clashes_and_keeps_generations() -> None:
    ix = Index(IndexLimits(cache_policy="lru"), FakeClock())
    keys = [key(i) for i in range(6)]
    inv = {1: [InventoryItem(k, i * ALIGN, BLK, csum(k), 0, 100 + i) for i, k in enumerate(keys)]}
    inv[1].append(InventoryItem(key(99), 2 * ALIGN, BLK, 1, 0, 7))  # overlaps an extent: refused
    inv[1].append(InventoryItem(key(98), 9 * ALIGN, BLK, 1, 0, 0))  # no generation: refused
    assert ix.register_daemon(spec("d1", 16), inv) == 2
    n, exists, rows = ix.lookup(b"".join(keys), True, True)
    assert (n, exists) == (6, [True] * 6)
    locs = ix.locations(rows)
    assert [(x.offset, x.checksum, x.gen) for x in locs] == [(i * ALIGN, csum(k), 100 + i) for i, k in enumerate(keys)]
    # A second daemon claiming the same keys is refused them, with a tombstone for each.
    assert ix.register_daemon(spec("d2", 16), inv) == 8
    assert len(ix.take_tombstones(["d2"])["d2"]) == 6
    ix.check_integrity()


def test_location_rows_are_the_wire_rows() -> None:
    ix = Index(IndexLimits(cache_policy="lru"), FakeClock())
    keys = [key(i) for i in range(5)]
    inv = {1: [InventoryItem(k, 2 * i * ALIGN, BLK + i, csum(k), 0, 500 + i) for i, k in enumerate(keys)]}
    assert ix.register_daemon(spec("d1", 16), inv) == 0
    rows = ix.lookup(b"".join(keys), with_locations=True)[2]
    want = b"".join(ROW.pack(1, 0, 2 * i * ALIGN, BLK + i, csum(k), 500 + i) for i, k in enumerate(keys))
    assert ix.location_rows(rows) == want == b"".join(x.row for x in ix.locations(rows))


def test_a_leased_block_is_never_evicted_and_its_extent_outlives_its_removal() -> None:
    cmp = Index(IndexLimits(cache_policy="lru"), FakeClock())
    cmp.register_daemon(spec("d1", 2), {})
    a, b, c = key(1), key(2), key(3)
    p = cmp.put_start(a + b, [BLK, BLK])
    cmp.put_commit(p.put_id, [1, 2])
    lease = cmp.acquire(a + b)
    assert lease.hit_count == 2
    with pytest.raises(KVStoreError):  # nothing evictable: both are leased
        cmp.put_start(c, [BLK])
    assert cmp.remove(a) == 1
    assert cmp.table.n_rows == 2 and cmp.segments[1].alloc.used == 2 * ALIGN  # held by the lease
    cmp.release(lease.lease_id)
    assert cmp.segments[1].alloc.used == ALIGN
    p = cmp.put_start(c, [BLK])  # b is evicted (a's extent is free)
    assert p.status == [0]
    cmp.check_integrity()


@pytest.mark.parametrize("n", [1, 700, 5000])
def test_the_table_finds_what_it_holds_and_only_that_through_growth_and_deletion(n: int) -> None:
    rnd = np.random.default_rng(n)
    t = BlockTable(rows=4, seed=n)
    packed = rnd.integers(0, 2**63, size=2 * n, dtype=np.uint64).tobytes()
    q = words(packed)
    rows = t.add(q)
    assert (t.find(q) == rows).all()
    gone = rnd.random(n) < 0.5
    for r in rows[gone].tolist():
        t.unlink(r)
        t.free(r)
    found = t.find(q)
    assert (found[gone] == -1).all() and (found[~gone] == rows[~gone]).all()
    t.check_integrity()
    # Freed rows are reused; the keys come back out as they went in.
    again = t.add(q[gone])
    assert set(again.tolist()) == set(rows[gone].tolist())
    assert t.keys(again) == b"".join(packed[16 * i : 16 * i + 16] for i in np.flatnonzero(gone))
    t.check_integrity()


def test_the_oldest_evictable_row_is_exact_while_its_candidate_list_goes_stale() -> None:
    """Eviction candidates are computed in batches (here of 4, so they go stale all the time):
    after any mix of touches, leases, pins, removals and new rows, the row offered is the least
    recent evictable row of its segment, as a scan of every row finds it."""
    rnd = random.Random(5)
    t = BlockTable(rows=8, seed=5)
    nxt = iter(range(1, 10**6))

    def new(n: int) -> None:
        rows = t.add(np.array([[next(nxt), 7] for _ in range(n)], dtype=np.uint64))
        t.seg[rows] = [rnd.choice((1, 2)) for _ in rows]
        t.set_ready(rows)
        t.stamp(rows)

    new(200)
    for _ in range(3000):
        live = np.flatnonzero(t.flags[: t.n_rows] & 1)
        op = rnd.random()
        if op < 0.3:
            t.stamp(np.array(rnd.sample(live.tolist(), min(len(live), rnd.randint(1, 5)))))
        elif op < 0.45:
            r = rnd.choice(live.tolist())
            t.leases[r] = 1 - t.leases[r] if t.leases[r] <= 1 else t.leases[r]
            if t.leases[r] == 0:
                t.stamp_one(r)  # a row evictable again is most recent
        elif op < 0.55:
            r = rnd.choice(live.tolist())
            t.flags[r] ^= 4  # PINNED
            if not t.flags[r] & 4:
                t.stamp_one(r)
        elif op < 0.75 and len(live) > 20:
            ref = rnd.choice((1, 2))
            r = t.oldest(ref, batch=4)
            if r >= 0 and rnd.random() < 0.8:  # evict it
                t.unlink(r)
                t.free(r)
        else:
            new(rnd.randint(1, 4))
        for ref in (1, 2):
            n = t.n_rows
            ok = np.flatnonzero(t.evictable(np.arange(n)) & (t.seg[:n] == ref))
            want = int(ok[np.argmin(t.recent[ok])]) if len(ok) else -1
            assert t.oldest(ref, batch=4) == want
    t.check_integrity()


@pytest.mark.parametrize("bad", [-1, 1 << 64])
def test_a_checksum_out_of_range_is_refused_before_anything_changes(bad: int) -> None:
    ix = Index(IndexLimits(cache_policy="lru"), FakeClock())
    ix.register_daemon(spec("d1", 4), {})
    p = ix.put_start(key(1) + key(2), [BLK, BLK])
    with pytest.raises(InvalidArgument, match=r"checksums\[1\]"):
        ix.put_commit(p.put_id, [5, bad])
    assert ix.lookup(key(1))[0] == 0
    assert ix.put_commit(p.put_id, [5, 6]) == 2  # the put is still there, whole
    assert ix.lookup(key(1) + key(2))[0] == 2
    ix.check_integrity()


def test_a_pending_put_never_takes_over_the_block_its_lost_daemon_reports_back() -> None:
    """A daemon lost while a put is pending comes back with the block committed (same key, same
    generation, and the block table hands it the same row): the put's commit or expiry must
    leave it alone."""
    for then in ("commit", "expire"):
        clock = FakeClock()
        ix = Index(IndexLimits(cache_policy="lru"), clock)
        ix.register_daemon(spec("d1", 4), {})
        k = key(1)
        p = ix.put_start(k, [BLK])
        gen = ix.locations(p.placements)[0].gen
        off = ix.locations(p.placements)[0].offset
        clock.advance(5.0)  # past the daemon's ttl, not the put's
        assert ix.expire()["daemons"] == 1
        inv = {1: [InventoryItem(k, off, BLK, 77, 0, gen)]}
        assert ix.register_daemon(spec("d1", 4), inv) == 0
        if then == "commit":
            assert ix.put_commit(p.put_id, [77]) == 0
        else:
            clock.advance(31.0)
            ix.heartbeat("d1")
            assert ix.expire()["puts"] == 1
        assert ix.lookup(k)[0] == 1
        assert ix.take_tombstones() == {}
        ix.check_integrity()


def test_blocks_and_inventory_past_32_bits_are_stored_or_refused_whole() -> None:
    clock = FakeClock()
    cmp = Index(IndexLimits(cache_policy="lru", max_block_bytes=1 << 33), clock)
    big = SegmentSpec(1, Tier.DRAM, 8 << 30, "/dev/shm/big")
    cmp.register_daemon(DaemonSpec("d1", "h", "a", "c", (big,)), {})
    p = cmp.put_start(key(1), [5 << 30])
    assert cmp.put_commit(p.put_id, [3]) == 1
    (loc,) = cmp.locations(cmp.lookup(key(1), with_locations=True)[2])
    assert loc.length == 5 << 30 and loc.size >= 5 << 30
    cmp.check_integrity()
    # A daemon's item whose values do not fit 64 bits is refused; the rest is adopted.
    inv = {1: [InventoryItem(key(2), 0, 1 << 64, 1, ALIGN, 9), InventoryItem(key(3), ALIGN, BLK, 1, 0, 10)]}
    assert cmp.register_daemon(spec("d2", 4), inv) == 1
    assert cmp.lookup(key(3))[0] == 1 and cmp.lookup(key(2))[0] == 0
    cmp.check_integrity()


def test_results_are_copies_of_the_index_state() -> None:
    cmp = Index(IndexLimits(cache_policy="lru"), FakeClock())
    cmp.register_daemon(spec("d1", 4), {})
    p = cmp.put_start(key(1) + key(2), [BLK, BLK])
    p.placements[:] = 0  # a caller scribbling on what it was given
    assert cmp.put_commit(p.put_id, [1, 2]) == 2
    a = cmp.acquire(key(1) + key(2))
    a.locations[:] = 0
    cmp.release(a.lease_id)
    cmp.check_integrity()
    assert cmp.lookup(key(1) + key(2))[0] == 2


@pytest.mark.parametrize("bad", [1.5, "7", None])
def test_a_checksum_that_is_not_an_integer_is_refused(bad) -> None:  # noqa: ANN001
    ix = Index(IndexLimits(cache_policy="lru"), FakeClock())
    ix.register_daemon(spec("d1", 4), {})
    p = ix.put_start(key(1), [BLK])
    with pytest.raises(InvalidArgument, match=r"checksums\[0\]"):
        ix.put_commit(p.put_id, [bad])


def test_registration_in_steps_takes_no_puts_until_adopted_and_can_be_superseded() -> None:
    clock = FakeClock()
    ix = Index(IndexLimits(cache_policy="lru"), clock)
    ix.register_daemon(spec("d1", 8), {})
    keys = [key(i) for i in range(5)]
    inv = {1: [InventoryItem(k, i * ALIGN, BLK, csum(k), 0, 10 + i) for i, k in enumerate(keys)]}
    steps = ix.register_daemon_steps(spec("d2", 8), inv, chunk=2)
    next(steps)  # one step in: the daemon known, its extents reserved, nothing adopted yet
    assert ix.daemons["d2"].adopting and ix.lookup(b"".join(keys))[0] == 0
    next(steps)  # part adopted, the daemon still not placeable
    assert ix.daemons["d2"].adopting and ix.lookup(b"".join(keys))[0] == 2  # a chunk of 2
    r = ix.put_start(key(50), [BLK], host_id="h-d2")
    assert ix.locations(r.placements)[0].segment.daemon.spec.daemon_id == "d1"
    clock.advance(ix.limits.daemon_ttl_s * 0.9)
    ix.heartbeat("d1")
    next(steps)  # the adopting daemon's lease is renewed at every step
    clock.advance(ix.limits.daemon_ttl_s * 0.9)
    ix.heartbeat("d1")
    assert ix.expire()["daemons"] == 0 and "d2" in ix.daemons
    with pytest.raises(StopIteration) as done:
        next(steps)
    assert done.value.value == 0 and not ix.daemons["d2"].adopting and ix.lookup(b"".join(keys))[0] == 5
    ix.put_abort(r.put_id)
    ix.check_integrity()
    # A second registration in the middle of the first supersedes it.
    later = [key(i) for i in range(10, 15)]
    first = ix.register_daemon_steps(
        spec("d3", 8), {1: [InventoryItem(k, i * ALIGN, BLK, 1, 0, 30 + i) for i, k in enumerate(later)]}, chunk=2
    )
    next(first)
    assert ix.register_daemon(spec("d3", 8), {1: [InventoryItem(key(20), 0, BLK, 1, 0, 40)]}) == 0
    with pytest.raises(StopIteration):
        next(first)
    assert ix.lookup(key(20))[0] == 1 and ix.lookup(later[0])[0] == 0 and ix.lookup(later[2])[0] == 0
    ix.check_integrity()


def test_a_drained_daemon_leaves_now_and_its_leases_are_followed() -> None:
    clock = FakeClock()
    ix = Index(IndexLimits(cache_policy="lru"), clock)
    ix.register_daemon(spec("d1", 8), {})
    p = ix.put_start(key(1) + key(2), [BLK, BLK])
    assert ix.put_commit(p.put_id, [1, 2]) == 2
    lease = ix.acquire(key(1), ttl_s=5.0)
    assert ix.drain_daemon("d1") == (2, 1, 5.0)
    assert "d1" not in ix.daemons and ix.lookup(key(1) + key(2))[0] == 0 and len(ix) == 0
    clock.advance(2.0)
    assert ix.drain_daemon("d1") == (0, 1, 3.0)  # called again: nothing dropped, the lease followed
    ix.release(lease.lease_id)
    assert ix.drain_daemon("d1") == (0, 0, 0.0)
    assert ix.counters["daemons_drained"] == 1
    ix.check_integrity()


def test_commit_outcomes_for_blocks_not_of_the_put_change_nothing() -> None:
    ix = Index(IndexLimits(cache_policy="lru"), FakeClock())
    ix.register_daemon(spec("d1", 8), {})
    p = ix.put_start(key(1) + key(2), [BLK, BLK])
    pc = ix.put_commit_begin(p.put_id, [1, 2])
    assert ix.put_commit_end(pc, {5: (2, 0), -1: (2, 0)}) == (2, [0, 0])
    assert ix.lookup(key(1) + key(2))[0] == 2
    ix.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_a_put_into_free_space_places_as_block_by_block(seed: int, monkeypatch) -> None:  # noqa: ANN001
    """Puts of one block size that fit the first segment's free space are placed in one pass:
    the same statuses, segments and extents as the block-by-block path gives, through dedup,
    removals that fragment the segment, and puts that do not fit (which take the general path)."""
    rnd = random.Random(seed)
    fast, slow = (Index(IndexLimits(cache_policy="lru"), FakeClock()) for _ in range(2))
    monkeypatch.setattr(slow, "_put_in_free_space", lambda *a: None)
    for ix in (fast, slow):
        ix.register_daemon(spec("d1", 3000), {})
    universe = [key(i) for i in range(4000)]
    for _ in range(40):
        lo = rnd.randrange(len(universe) - 300)
        keys = universe[lo : lo + rnd.randint(60, 300)]
        size = rnd.choice((BLK, 2 * ALIGN - HEADER_SIZE))
        commit = rnd.random() < 0.9
        got = []
        for ix in (fast, slow):
            try:
                r = ix.put_start(b"".join(keys), [size] * len(keys))
            except KVStoreError as e:
                got.append(type(e))
                continue
            got.append((r.status, [(x.segment.ref, x.offset, x.size) for x in ix.locations(r.placements)]))
            if r.placements.size and commit:
                assert ix.put_commit(r.put_id, [7] * len(r.placements)) == len(r.placements)
            elif r.placements.size:
                ix.put_abort(r.put_id)
        assert got[0] == got[1]
        gone = b"".join(rnd.sample(universe, 150))
        assert fast.remove(gone) == slow.remove(gone)
        fast.check_integrity()
        slow.check_integrity()
    assert fast.lookup(b"".join(universe), True)[1] == slow.lookup(b"".join(universe), True)[1]
