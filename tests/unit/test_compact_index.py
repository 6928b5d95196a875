"""The compact index (kvstore.meta.compact) against the object index (kvstore.meta.index, lru
policy): random operation sequences on both give the same answers (hit counts, per-key
existence, placements and locations, put and commit outcomes, errors, expiries, tombstones),
and both keep their accounting at every step. Plus the columnar table's own invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest

import kvstore.meta.counts
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.extent import ALIGN, HEADER_SIZE
from kvstore.meta.compact import CompactIndex
from kvstore.meta.duel import FREQUENCY, RECENCY, SECOND_CHANCE
from kvstore.meta.index import DaemonSpec, Index, IndexLimits, InventoryItem, SegmentSpec, Tier
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


def where_obj(reps) -> list[tuple]:  # noqa: ANN001
    return [(r.segment.daemon.spec.daemon_id, r.segment.spec.segment_id, r.offset, r.size, r.length) for r in reps]


def where_compact(ix: CompactIndex, rows) -> list[tuple]:  # noqa: ANN001
    return [(x.segment.daemon.spec.daemon_id, x.segment.spec.segment_id, x.offset, x.size, x.length)
            for x in ix.locations(rows)]  # fmt: skip


def both(a, b):  # noqa: ANN001, ANN201
    """Runs two calls; both raise the same error type, or both answer."""
    out = []
    for f in (a, b):
        try:
            out.append(("ok", f()))
        except KVStoreError as e:
            out.append(("err", type(e)))
    assert out[0][0] == out[1][0], out
    if out[0][0] == "err":
        assert out[0][1] is out[1][1], out
        return None
    return out[0][1], out[1][1]


class Pair:
    """The two indexes driven alike."""

    def __init__(self, seed: int, policy: str = "lru") -> None:
        self.rnd = random.Random(seed)
        self.clock = FakeClock()
        limits = IndexLimits(cache_policy=policy, max_batch_keys=64)
        self.obj = Index(limits, self.clock)
        self.cmp = CompactIndex(limits, self.clock, rows=16)
        self.mode = RECENCY
        if policy == "adaptive":
            # The mode follows a schedule of this test (the same for both), not the duel: every
            # mode and every switch between them is driven through both indexes.
            for pol in (self.obj.policy, self.cmp.policy):
                pol.duel.decide = (lambda d: lambda: setattr(d, "mode", self.mode))(pol.duel)
        self.daemons = {"d1": 12, "d2": 7}
        for d, slots in self.daemons.items():
            assert self.obj.register_daemon(spec(d, slots), {}) == self.cmp.register_daemon(spec(d, slots), {})
        # Chains over a small universe: a few shared heads, private tails.
        self.chains = [[key(1000 * c + i) for i in range(self.rnd.randint(2, 9))] for c in range(6)]
        self.puts: list[tuple[int, int, int]] = []  # (obj put, compact put, allocated count)
        self.leases: list[tuple[int, int, int]] = []

    def chain(self) -> list[bytes]:
        c = self.rnd.choice(self.chains)
        return c[: self.rnd.randint(1, len(c))]

    def commit_in_two(self, pa: int, pb: int, n: int, sums: list[int]) -> None:
        """A commit as the service makes one: the first half, the daemons' answers (some
        refused, some stored in fewer bytes), maybe the loss of a daemon meanwhile, the second."""
        rnd, obj, cmp = self.rnd, self.obj, self.cmp
        written = [rnd.random() < 0.9 for _ in range(n)] if rnd.random() < 0.3 else None
        got = both(lambda: obj.put_commit_begin(pa, sums, written), lambda: cmp.put_commit_begin(pb, sums, written))
        if not got:
            return
        ca, cb = got
        assert ca.status == cb.status
        assert [(r.key, r.offset, r.length) if r else None for r in ca.replicas] == [
            (r.key, r.offset, r.length) if r else None for r in cb.replicas
        ]
        outcome = {}
        for i, rep in enumerate(ca.replicas):
            if rep is None or rnd.random() < 0.6:
                continue
            if rnd.random() < 0.5:
                outcome[i] = (rnd.choice((2, 3, 4)), 0)  # MISMATCH, NO_SPACE, UNAVAILABLE
            elif rep.size > ALIGN:
                outcome[i] = (0, ALIGN)  # stored in fewer bytes: the rest of the extent goes back
        if rnd.random() < 0.1:
            d = rnd.choice(sorted(self.daemons))
            obj._drop_daemon(d)
            cmp._drop_daemon(d)
            assert obj.register_daemon(spec(d, self.daemons[d]), {}) == cmp.register_daemon(
                spec(d, self.daemons[d]), {}
            )
        assert obj.put_commit_end(ca, outcome) == cmp.put_commit_end(cb, outcome)

    def step(self) -> None:
        rnd, obj, cmp = self.rnd, self.obj, self.cmp
        if rnd.random() < 0.01:
            self.mode = rnd.choice((RECENCY, SECOND_CHANCE, FREQUENCY))
        op = rnd.random()
        if op < 0.25:
            keys = self.chain()
            sizes = [rnd.choice((BLK, BLK, 2 * ALIGN - HEADER_SIZE)) for _ in keys]
            host = rnd.choice(("", "h-d2"))
            got = both(lambda: obj.put_start(b"".join(keys), sizes, host),
                       lambda: cmp.put_start(b"".join(keys), sizes, host))  # fmt: skip
            if got:
                a, b = got
                assert a.status == b.status
                assert where_obj(a.placements) == where_compact(cmp, b.placements)
                if a.placements:
                    self.puts.append(
                        (a.put_id, b.put_id, len(a.placements), [csum(k) for k, s in zip(keys, a.status) if s == 0])
                    )
        elif op < 0.40 and self.puts:
            pa, pb, n, sums = self.puts.pop(rnd.randrange(len(self.puts)))
            r = rnd.random()
            if r < 0.15:
                assert both(lambda: obj.put_abort(pa), lambda: cmp.put_abort(pb)) in (None,) or True
            elif r < 0.55:
                self.commit_in_two(pa, pb, n, sums)
            else:
                written = [rnd.random() < 0.9 for _ in range(n)] if r < 0.3 else None
                got = both(lambda: obj.put_commit(pa, sums, written), lambda: cmp.put_commit(pb, sums, written))
                if got:
                    assert got[0] == got[1]
        elif op < 0.55:
            keys = b"".join(self.chain())
            got = both(lambda: obj.lookup(keys, True, True), lambda: cmp.lookup(keys, True, True))
            (na, ea, la), (nb, eb, lb) = got
            assert (na, ea) == (nb, eb)
            assert where_obj(la) == where_compact(cmp, lb)
            assert [r.checksum for r in la] == [x.checksum for x in cmp.locations(lb)]
        elif op < 0.68:
            keys = b"".join(self.chain())
            a, b = both(lambda: obj.acquire(keys), lambda: cmp.acquire(keys))
            assert a.hit_count == b.hit_count
            assert where_obj(a.locations) == where_compact(cmp, b.locations)
            if a.hit_count:
                self.leases.append((a.lease_id, b.lease_id, a.hit_count))
        elif op < 0.80 and self.leases:
            la, lb, n = self.leases.pop(rnd.randrange(len(self.leases)))
            bad = [i for i in range(n) if rnd.random() < 0.05]
            both(lambda: obj.release(la, bad), lambda: cmp.release(lb, bad))
        elif op < 0.84:
            keys = b"".join(rnd.sample(self.chain(), 1))
            a, b = both(lambda: obj.remove(keys), lambda: cmp.remove(keys))
            assert a == b
        elif op < 0.88:
            keys = b"".join(self.chain())
            flag = rnd.random() < 0.5
            a, b = both(lambda: obj.pin(keys, flag), lambda: cmp.pin(keys, flag))
            assert a == b
        elif op < 0.91:
            chains = [b"".join(self.chain()) for _ in range(rnd.randint(1, 3))]
            a, b = both(lambda: obj.touch(chains), lambda: cmp.touch(chains))
            assert a == b
        elif op < 0.92:
            keys = b"".join(self.chain())
            assert obj.tiers(keys)[0] == cmp.tiers(keys)[0]
            assert obj.pin_candidates(keys) == cmp.pin_candidates(keys)
            assert [obj.is_pinned(k) for k in self.chains[0]] == [cmp.is_pinned(k) for k in self.chains[0]]
            assert len(obj) == len(cmp)
        elif op < 0.925:
            d = rnd.choice(sorted(self.daemons))
            a, b = obj.drain_daemon(d), cmp.drain_daemon(d)
            assert a == b
            assert obj.register_daemon(spec(d, self.daemons[d]), {}) == cmp.register_daemon(
                spec(d, self.daemons[d]), {}
            )
        elif op < 0.97:
            self.clock.advance(rnd.choice((0.5, 2.0, 12.0)))
            for d in self.daemons:
                if rnd.random() < 0.97:
                    assert obj.heartbeat(d) == cmp.heartbeat(d)
            a, b = obj.expire(), cmp.expire()
            assert a == b
            for d, slots in self.daemons.items():
                if d not in obj.daemons:  # lost: it comes back empty
                    assert obj.register_daemon(spec(d, slots), {}) == cmp.register_daemon(spec(d, slots), {})
        else:
            ta, tb = obj.take_tombstones(), cmp.take_tombstones()
            strip = lambda t: {d: sorted((x.segment_id, x.key, x.offset) for x in v) for d, v in t.items()}  # noqa: E731
            assert strip(ta) == strip(tb)
        obj.check_integrity()
        cmp.check_integrity()


@pytest.mark.parametrize("seed", range(12))
def test_the_compact_index_answers_as_the_object_index_on_random_operations(seed: int) -> None:
    pair = Pair(seed)
    for _ in range(1500):
        pair.step()
    assert pair.obj.counters["evictions"] > 0  # the capacity was short: eviction order was compared
    assert pair.obj.counters["commit_failed_keys"] > 0  # daemons refused blocks in two-phase commits
    assert pair.obj.counters["daemons_drained"] > 0
    names = ("hit_keys", "miss_keys", "put_keys", "evictions", "removed", "expired_leases", "tombstones")
    for name in (*names, "commit_failed_keys", "daemons_drained", "put_bytes"):
        assert pair.obj.counters[name] == pair.cmp.counters[name], name


@pytest.mark.parametrize("seed", range(12))
def test_with_the_adaptive_policy_the_compact_index_decides_as_the_object_index(seed: int, monkeypatch) -> None:  # noqa: ANN001
    # A small floor for the policy's population, so that counts age and the history of blocks
    # not stored is trimmed within the run; the mode changes on a schedule (see Pair).
    monkeypatch.setattr(kvstore.meta.counts, "MIN_POPULATION", 4)
    pair = Pair(seed, "adaptive")
    for _ in range(1500):
        pair.step()
    obj, cmp = pair.obj, pair.cmp
    assert obj.counters["evictions"] > 0 and obj.counters["not_admitted_keys"] > 0
    assert obj.policy.epoch > 2 and all(obj.policy.duel.keys_in)  # counts aged; reads in every mode
    for name in ("hit_keys", "miss_keys", "put_keys", "evictions", "not_admitted_keys", "removed", "tombstones"):
        assert obj.counters[name] == cmp.counters[name], name
    assert (obj.policy.epoch, obj.policy._spell) == (cmp.policy.epoch, cmp.policy._spell)
    # The same counts remembered, in the same order (it decides which are forgotten first).
    assert list(obj.policy.history.items()) == list(cmp.policy.history.items())
    stored = [k for c in pair.chains for k in c if obj.policy.count(k)]
    assert stored and [obj.policy.count(k) for k in stored] == [cmp.policy.count(k) for k in stored]


def test_inventory_adoption_answers_as_the_object_index() -> None:
    clock = FakeClock()
    limits = IndexLimits(cache_policy="lru")
    obj, cmp = Index(limits, clock), CompactIndex(limits, clock)
    keys = [key(i) for i in range(6)]
    inv = {1: [InventoryItem(k, i * ALIGN, BLK, csum(k), 0, 100 + i) for i, k in enumerate(keys)]}
    inv[1].append(InventoryItem(key(99), 2 * ALIGN, BLK, 1, 0, 7))  # overlaps an extent: refused
    inv[1].append(InventoryItem(key(98), 9 * ALIGN, BLK, 1, 0, 0))  # no generation: refused
    assert obj.register_daemon(spec("d1", 16), inv) == cmp.register_daemon(spec("d1", 16), inv) == 2
    packed = b"".join(keys)
    (na, ea, la), (nb, eb, lb) = obj.lookup(packed, True, True), cmp.lookup(packed, True, True)
    assert (na, ea) == (nb, eb) == (6, [True] * 6)
    assert where_obj(la) == where_compact(cmp, lb)
    assert [x.gen for x in cmp.locations(lb)] == [r.gen for r in la] == list(range(100, 106))
    # A second daemon claiming the same keys is refused them, with a tombstone for each.
    assert obj.register_daemon(spec("d2", 16), inv) == cmp.register_daemon(spec("d2", 16), inv) == 8
    assert len(obj.take_tombstones(["d2"])["d2"]) == len(cmp.take_tombstones(["d2"])["d2"]) == 6
    obj.check_integrity()
    cmp.check_integrity()


def test_location_rows_are_the_wire_rows_of_the_object_index() -> None:
    clock = FakeClock()
    limits = IndexLimits(cache_policy="lru")
    obj, cmp = Index(limits, clock), CompactIndex(limits, clock)
    keys = [key(i) for i in range(5)]
    inv = {1: [InventoryItem(k, i * ALIGN, BLK + i, csum(k), 0, 500 + i) for i, k in enumerate(keys)]}
    obj.register_daemon(spec("d1", 16), inv)
    cmp.register_daemon(spec("d1", 16), inv)
    la = obj.lookup(b"".join(keys), with_locations=True)[2]
    lb = cmp.lookup(b"".join(keys), with_locations=True)[2]
    assert cmp.location_rows(lb) == b"".join(r.row for r in la)  # both number their first segment 1


def test_a_leased_block_is_never_evicted_and_its_extent_outlives_its_removal() -> None:
    cmp = CompactIndex(IndexLimits(cache_policy="lru"), FakeClock())
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


@pytest.mark.parametrize("make", [Index, CompactIndex], ids=["object", "compact"])
@pytest.mark.parametrize("bad", [-1, 1 << 64])
def test_a_checksum_out_of_range_is_refused_before_anything_changes(make, bad: int) -> None:  # noqa: ANN001
    ix = make(IndexLimits(cache_policy="lru"), FakeClock())
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
    leave it alone, as the object index does."""
    for then in ("commit", "expire"):
        clock = FakeClock()
        limits = IndexLimits(cache_policy="lru")
        obj, cmp = Index(limits, clock), CompactIndex(limits, clock)
        for ix in (obj, cmp):
            ix.register_daemon(spec("d1", 4), {})
        k = key(1)
        pa, pb = obj.put_start(k, [BLK]), cmp.put_start(k, [BLK])
        gen = cmp.locations(pb.placements)[0].gen
        off = cmp.locations(pb.placements)[0].offset
        clock.advance(5.0)  # past the daemon's ttl, not the put's
        assert obj.expire()["daemons"] == cmp.expire()["daemons"] == 1
        inv = {1: [InventoryItem(k, off, BLK, 77, 0, gen)]}
        assert obj.register_daemon(spec("d1", 4), inv) == cmp.register_daemon(spec("d1", 4), inv) == 0
        if then == "commit":
            assert obj.put_commit(pa.put_id, [77]) == cmp.put_commit(pb.put_id, [77]) == 0
        else:
            clock.advance(31.0)
            for ix in (obj, cmp):
                ix.heartbeat("d1")
            a, b = obj.expire(), cmp.expire()
            assert a["puts"] == b["puts"] == 1
        assert obj.lookup(k)[0] == cmp.lookup(k)[0] == 1
        assert obj.take_tombstones() == {} and cmp.take_tombstones() == {}
        obj.check_integrity()
        cmp.check_integrity()


def test_blocks_and_inventory_past_32_bits_are_stored_or_refused_whole() -> None:
    clock = FakeClock()
    cmp = CompactIndex(IndexLimits(cache_policy="lru", max_block_bytes=1 << 33), clock)
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
    cmp = CompactIndex(IndexLimits(cache_policy="lru"), FakeClock())
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
    for make in (Index, CompactIndex):
        ix = make(IndexLimits(cache_policy="lru"), FakeClock())
        ix.register_daemon(spec("d1", 4), {})
        p = ix.put_start(key(1), [BLK])
        with pytest.raises(InvalidArgument, match=r"checksums\[0\]"):
            ix.put_commit(p.put_id, [bad])


@pytest.mark.parametrize("make", [Index, CompactIndex], ids=["object", "compact"])
def test_registration_in_steps_takes_no_puts_until_adopted_and_can_be_superseded(make) -> None:  # noqa: ANN001
    clock = FakeClock()
    ix = make(IndexLimits(cache_policy="lru"), clock)
    ix.register_daemon(spec("d1", 8), {})
    keys = [key(i) for i in range(5)]
    inv = {1: [InventoryItem(k, i * ALIGN, BLK, csum(k), 0, 10 + i) for i, k in enumerate(keys)]}
    steps = ix.register_daemon_steps(spec("d2", 8), inv, chunk=2)
    next(steps)  # one step in: part adopted, the daemon known but not placeable
    assert ix.daemons["d2"].adopting and ix.lookup(b"".join(keys))[0] == 1
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


@pytest.mark.parametrize("make", [Index, CompactIndex], ids=["object", "compact"])
def test_a_drained_daemon_leaves_now_and_its_leases_are_followed(make) -> None:  # noqa: ANN001
    clock = FakeClock()
    ix = make(IndexLimits(cache_policy="lru"), clock)
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


@pytest.mark.parametrize("make", [Index, CompactIndex], ids=["object", "compact"])
def test_commit_outcomes_for_blocks_not_of_the_put_change_nothing(make) -> None:  # noqa: ANN001
    ix = make(IndexLimits(cache_policy="lru"), FakeClock())
    ix.register_daemon(spec("d1", 8), {})
    p = ix.put_start(key(1) + key(2), [BLK, BLK])
    pc = ix.put_commit_begin(p.put_id, [1, 2])
    assert ix.put_commit_end(pc, {5: (2, 0), -1: (2, 0)}) == (2, [0, 0])
    assert ix.lookup(key(1) + key(2))[0] == 2
    ix.check_integrity()
