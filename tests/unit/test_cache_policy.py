"""The index's cache policy (kvstore.meta.policy) driven through the real Index: the invariants
of every mode (never evicts what is leased, pinned or being written; a chain's tail before its
head; admission in chain order; bounded history and ghosts), the balanced mode's ARC (T1 before
T2 while T1 is over its target, the target following the ghosts), the mode choice
(kvstore.meta.duel), and aging. Every index check also checks the policy's own accounting."""

from __future__ import annotations

import random

import pytest

from kvstore.meta import duel as du
from kvstore.meta import policy as pol
from kvstore.meta.duel import BALANCED, FREQUENCY, RECENCY
from kvstore.meta.index import Index, IndexLimits, PutStatus
from tests.unit.test_index import BLK, FakeClock, dspec, k, pk, seg

ALLOCATED = PutStatus.ALLOCATED
NOT_ADMITTED = PutStatus.NOT_ADMITTED


def make(slots: int = 8, policy: str = "adaptive", mode: int | None = None) -> Index:
    idx = Index(IndexLimits(cache_policy=policy), FakeClock())
    idx.register_daemon(dspec(slots=slots), {})
    if mode is not None:
        idx.policy.duel.mode = mode  # pin the mode: these tests are about what each mode does
        idx.policy.duel.choose = lambda hits, var: None  # type: ignore[method-assign]
    return idx


def read(idx: Index, *ids: int) -> int:
    """A request's read: acquire the chain (counted by the policy), release."""
    got = idx.acquire(pk(*ids))
    if got.lease_id:
        idx.release(got.lease_id)
    return got.hit_count


def store(idx: Index, *ids: int, check: bool = True) -> list[int]:
    r = idx.put_start(pk(*ids), [BLK] * len(ids))
    n = r.status.count(ALLOCATED)
    if n:
        assert idx.put_commit(r.put_id, [7] * n) == n
    if check:
        idx.check_integrity()
    return list(r.status)


def request(idx: Index, *ids: int, check: bool = True) -> int:
    h = read(idx, *ids)
    store(idx, *ids, check=check)
    return h


def test_policy_is_chosen_by_configuration():
    assert make(policy="lru").policy.name == "lru"
    assert make().policy.name == "adaptive"
    with pytest.raises(ValueError, match="unknown cache policy"):
        Index(IndexLimits(cache_policy="random"))


def test_frequency_mode_admits_only_blocks_hotter_than_the_victim():
    idx = make(slots=4, mode=FREQUENCY)
    for _ in range(3):
        request(idx, 0, 1, 2, 3)  # a hot chain fills the segment, counted 3 times
    # A new chain seen once: colder than anything it would evict, so it is declined, in chain
    # order, and that is not an error.
    read(idx, 10, 11)
    assert store(idx, 10, 11) == [NOT_ADMITTED, NOT_ADMITTED]
    assert k(10) not in idx.entries and read(idx, 0, 1, 2, 3) == 4
    assert idx.counters["not_admitted_keys"] == 2 and idx.counters["evictions"] == 0
    # Seen often enough, it earns its place: it displaces the least counted block, which is
    # the hot chain's tail (its head is counted as often, and more recent).
    for _ in range(5):
        read(idx, 10)
    assert store(idx, 10) == [ALLOCATED]
    assert k(3) not in idx.entries and read(idx, 0, 1, 2) == 3


def test_lru_policy_and_recency_and_balanced_modes_admit_everything():
    for idx in (make(slots=4, policy="lru"), make(slots=4, mode=RECENCY), make(slots=4, mode=BALANCED)):
        for _ in range(3):
            request(idx, 0, 1, 2, 3)
        read(idx, 10, 11)
        assert store(idx, 10, 11) == [ALLOCATED, ALLOCATED]
        assert read(idx, 0, 1) == 2 and read(idx, 2) == 0  # the chain's tail went first


def test_a_declined_block_stops_the_rest_of_the_put():
    idx = make(slots=4, mode=FREQUENCY)
    for _ in range(2):
        request(idx, 0, 1, 2, 3)
    for _ in range(4):
        read(idx, 20, 21)  # 20 and 21 are hot, 22 is not
    read(idx, 22)
    st = store(idx, 22, 20, 21)
    assert st == [NOT_ADMITTED, NOT_ADMITTED, NOT_ADMITTED]


@pytest.mark.parametrize("mode", [RECENCY, BALANCED, FREQUENCY])
def test_never_evicts_leased_pinned_or_unwritten_blocks(mode: int):
    rng = random.Random(5)
    idx = make(slots=6, mode=mode)
    for _ in range(4):
        request(idx, 0, 1, 2, 3, 4, 5)
    lease = idx.acquire(pk(0, 1))  # leased
    idx.pin(pk(2))  # pinned
    pending = idx.put_start(pk(30), [BLK])  # being written (no room: evicts 5, the tail)
    assert pending.status in ([ALLOCATED], [NOT_ADMITTED])
    protected = {k(0), k(1), k(2)} | ({k(30)} if pending.status == [ALLOCATED] else set())
    for i in range(200):
        ids = [100 + rng.randrange(40) for _ in range(rng.randrange(1, 4))]
        for _ in range(rng.randrange(1, 6)):
            read(idx, *ids)
        try:
            store(idx, *dict.fromkeys(ids))
        except Exception as e:  # every evictable block is protected: ResourceExhausted
            assert type(e).__name__ == "ResourceExhausted", e
        assert protected <= set(idx.entries), f"step {i}: a protected block was evicted"
        idx.check_integrity()
    idx.release(lease.lease_id)
    if pending.status == [ALLOCATED]:
        idx.put_abort(pending.put_id)
    idx.check_integrity()


def test_frequency_mode_takes_a_chain_tail_before_its_head():
    idx = make(slots=8, mode=FREQUENCY)
    request(idx, 0, 1, 2, 3, 4, 5, 6, 7)
    request(idx, 0, 1, 2, 3, 4, 5, 6, 7)
    order = []
    for n in range(8):  # a hotter block each time displaces one block
        for _ in range(4 + n):
            read(idx, 50 + n)
        assert store(idx, 50 + n) == [ALLOCATED]
        order += [i for i in range(8) if k(i) not in idx.entries and i not in order]
    assert order == [7, 6, 5, 4, 3, 2, 1, 0]


def test_demotion_order_follows_the_mode():
    reps = []
    idx = make(slots=8, mode=FREQUENCY)
    request(idx, 0, 1, 2)
    for _ in range(5):
        read(idx, 0)
    read(idx, 1)
    reps = list(seg(idx).lru.values())  # least recent first: 2, 0, 1
    assert [r.entry.key for r in reps] == [k(2), k(0), k(1)]
    order = idx.policy.demotion_order(iter(reps), 3 * reps[0].size)
    assert [r.entry.key for r in order] == [k(2), k(1), k(0)]
    idx.policy.duel.mode = RECENCY
    order = idx.policy.demotion_order(iter(reps), 2 * reps[0].size)
    assert [r.entry.key for r in order] == [r.entry.key for r in reps[:2]]
    # Balanced: the list REPLACE takes from first (T1 over p = 0: 2, never read again), then
    # the other, each least recent first.
    idx.policy.duel.mode = BALANCED
    assert pol.seen_again(idx.entries[k(0)]) and pol.seen_again(idx.entries[k(1)])
    assert not pol.seen_again(idx.entries[k(2)])
    order = idx.policy.demotion_order(iter(reps), 3 * reps[0].size)
    assert [r.entry.key for r in order] == [k(2), k(0), k(1)]
    idx.policy.p = 10.0  # T1 within its target: T2's blocks go first
    order = idx.policy.demotion_order(iter(reps), 3 * reps[0].size)
    assert [r.entry.key for r in order] == [k(0), k(1), k(2)]


def test_history_is_bounded():
    idx = make(slots=4)
    limit = pol.HISTORY_FACTOR * pol.MIN_POPULATION
    for i in range(0, 3 * limit, 64):
        idx.acquire(b"".join((10**6 + j).to_bytes(16, "big") for j in range(i, i + 64)))
        assert len(idx.policy.history) <= limit
    assert len(idx.policy.history) == limit
    # The shadows are bounded too.
    lru, arc, lfu = idx.policy.duel.shadows
    assert len(lru.d) <= lru.capacity
    assert len(arc) <= arc.capacity and len(arc.ghosts) <= arc.capacity
    assert len(lfu.d) <= lfu.capacity
    assert len(lfu.history) <= pol.HISTORY_FACTOR * lfu.capacity


def test_counts_age_by_halving_each_epoch():
    idx = make(slots=4)
    request(idx, 0)
    for _ in range(9):
        read(idx, 0)
    assert idx.policy.count(k(0)) == 10
    idx.policy.epoch += 1
    assert idx.policy.count(k(0)) == 5
    idx.policy.epoch += 3
    assert idx.policy.count(k(0)) == 0
    read(idx, 0)
    assert idx.policy.count(k(0)) == 1
    # A block that leaves the index keeps its count in the history, and gets it back.
    for _ in range(3):
        read(idx, 0)
    idx.remove(pk(0))
    assert k(0) not in idx.entries and idx.policy.count(k(0)) == 4
    store(idx, 0)
    assert idx.policy.count(k(0)) == 4


def test_epochs_advance_with_accesses():
    idx = make(slots=4)
    before = idx.policy.epoch
    period = pol.AGE_FACTOR * pol.MIN_POPULATION
    keys = pk(*range(64))
    for _ in range(period // 64 + 1):
        idx.acquire(keys)
    assert idx.policy.epoch == before + 1


def _one_shot_scans_with_a_hot_set(idx: Index, rounds: int, rng: random.Random) -> int:
    """Traffic where frequency wins: a hot set read again and again, between long chains
    that are never read again."""
    hits = 0
    fresh = 10**6
    for _ in range(rounds):
        hot = rng.randrange(200)
        hits += request(idx, 5000 + hot, check=False)
        fresh += 40
        request(idx, *range(fresh, fresh + 40), check=False)
    return hits


def _recent_loops(idx: Index, rounds: int) -> int:
    """Traffic where recency wins: each chain is read again right after it is written."""
    hits = 0
    for r in range(rounds):
        ids = range(10_000 + 10 * r, 10_000 + 10 * r + 10)
        for _ in range(3):
            hits += request(idx, *ids, check=False)
    return hits


def test_the_mode_follows_what_the_traffic_rewards():
    rng = random.Random(1)
    freq = make(slots=400)
    got = _one_shot_scans_with_a_hot_set(freq, 1500, rng)
    assert freq.policy.frequency_mode
    lru = make(slots=400, policy="lru")
    base = _one_shot_scans_with_a_hot_set(lru, 1500, random.Random(1))
    assert got > 1.5 * base, (got, base)
    rec = make(slots=400)
    _recent_loops(rec, 400)
    assert not rec.policy.frequency_mode
    assert _recent_loops(rec, 50) == _recent_loops(make(slots=400, policy="lru"), 50)
    freq.check_integrity()


def test_the_mode_switches_only_on_a_difference_the_noise_does_not_explain():
    d = du.Duel()
    assert d.mode == RECENCY and d.free
    # Before the first eviction every mode has stored the same blocks: the most hits win.
    d.choose([98.0, 100.0, 99.0], [1e6] * 3)
    assert d.mode == BALANCED and d.switches == 1
    d.free = False
    # Noise of a pair: 2 x sqrt(its decayed sum of squared per-request differences); var holds
    # the pairs (recency, balanced), (recency, frequency), (balanced, frequency).
    d.choose([110.0, 100.0, 0.0], [100.0, 0.0, 0.0])  # 10 more, noise 20: stays
    assert d.mode == BALANCED and d.switches == 1
    d.choose([125.0, 100.0, 0.0], [100.0, 0.0, 0.0])  # 25 more: recency (no margin between the two)
    assert d.mode == RECENCY and d.switches == 2
    d.choose([1000.0, 0.0, 1040.0], [0.0, 100.0, 0.0])  # significant, but 4 % < the 5 % margin
    assert d.mode == RECENCY
    d.choose([1000.0, 0.0, 1060.0], [0.0, 1000.0, 0.0])  # 6 %, but 60 < 2 x sqrt(1000) = 63
    assert d.mode == RECENCY
    d.choose([1000.0, 0.0, 1060.0], [0.0, 100.0, 0.0])  # 6 % and 60 > 20
    assert d.mode == FREQUENCY and d.switches == 3
    # Back out of frequency takes the same margin.
    d.choose([0.0, 1040.0, 1000.0], [0.0, 0.0, 100.0])
    assert d.mode == FREQUENCY
    # Two modes clearly ahead: the one with the most hits.
    d.choose([1100.0, 1200.0, 1000.0], [0.0, 100.0, 100.0])
    assert d.mode == BALANCED and d.switches == 4


def test_the_paired_noise_follows_the_per_request_differences():
    """Shadows that agree on most requests: a small, steady advantage is significant; one that
    comes from a few long chains is not (the hit counts alone would say the opposite)."""
    steady, bursty = du.Duel(), du.Duel()
    for d in (steady, bursty):
        d.free = False
        d.mode = RECENCY
    for i in range(80):
        steady.choose(*_step(steady, (10, 11, 0)))  # balanced: 1 more hit on every request
        bursty.choose(*_step(bursty, (10, 60, 0) if i % 40 == 39 else (10, 10, 0)))  # 50 more, 1 in 40
    # steady: 80 more, noise 2 x sqrt(80) = 18 (counted as Poisson: 2 x sqrt(800 + 880) = 82);
    # bursty: 100 more, noise 2 x sqrt(2 x 50^2) = 141 (as Poisson: 2 x sqrt(800 + 900) = 82).
    assert steady.mode == BALANCED
    assert bursty.mode == RECENCY


def _step(d: du.Duel, got: tuple[int, int, int]) -> tuple[list[float], list[float]]:
    """Adds one request's shadow hits to ``d``'s sums as Duel.observe does (no decay)."""
    for i in range(3):
        d.hits[i] += got[i]
    d.var[0] += (got[0] - got[1]) ** 2
    d.var[1] += (got[0] - got[2]) ** 2
    d.var[2] += (got[1] - got[2]) ** 2
    return d.hits, d.var


def test_the_mode_is_free_until_the_first_eviction():
    idx = make(slots=8)
    assert idx.policy.mode == "recency" and idx.policy.duel.free
    for i in range(8):
        request(idx, i)
    assert idx.policy.duel.free, "nothing was evicted yet"
    request(idx, 100)
    assert not idx.policy.duel.free


def test_balanced_mode_follows_arc_in_one_recency_order():
    idx = make(slots=4, mode=BALANCED)
    p = idx.policy

    def ids(keys) -> list[int]:
        return [int.from_bytes(x, "big") - 1 for x in keys]  # k(i) is i + 1, big-endian

    request(idx, 0, 1)
    request(idx, 0, 1)  # read while stored: T2
    request(idx, 10)
    request(idx, 11)  # seen once: T1, more recent than 0 and 1
    assert [pol.seen_again(idx.entries[k(i)]) for i in (0, 1, 10, 11)] == [True, True, False, False]
    assert p.seen_again == 2 and p.p == 0
    # T1 holds 2 > p = 0: the victim is T1's least recent (10). The T2 blocks the search passed
    # (1, 0, the least recent of all) go back to T1 at its most recent end, tail first: where
    # recency would have evicted them, they get a second pass.
    request(idx, 20)
    assert ids(seg(idx).lru) == [11, 1, 0, 20] and p.seen_again == 0
    assert dict(p.ghosts) == {k(10): False}
    # 10, a ghost of T1, asked for again: p rises by max(|B2| / |B1|, 1) = 1 (recency would have
    # kept it); stored again (T1 of 4 over p: 11 goes) it is in T2.
    request(idx, 10)
    assert p.p == 1.0 and pol.seen_again(idx.entries[k(10)]) and k(11) not in idx.entries
    request(idx, 11)  # the same: p = 2; T1 (1, 0, 20) over it: 1 goes
    assert p.p == 2.0 and k(1) not in idx.entries
    assert ids(seg(idx).lru) == [0, 20, 10, 11] and p.seen_again == 2
    # T1 (0, 20) is now within p = 2: the victim is T2's least recent (10), though T1's blocks
    # are older.
    request(idx, 30)
    assert set(ids(idx.entries)) == {0, 20, 11, 30} and p.ghosts[k(10)] is True
    # A ghost of T2 asked for again lowers p by max(|B1| / |B2|, 1).
    b1 = sum(1 for v in p.ghosts.values() if not v)
    read(idx, 10)
    assert p.p == 2.0 - max(b1 / 1, 1.0)
    idx.check_integrity()


def test_balanced_mode_takes_a_chain_tail_before_its_head():
    idx = make(slots=8, mode=BALANCED)
    request(idx, 0, 1, 2, 3, 4, 5, 6, 7)
    request(idx, 0, 1, 2, 3, 4, 5, 6, 7)  # all T2
    idx.policy.p = 100.0  # T1 within its target: the victims come from T2
    order = []
    for n in range(8):
        assert store(idx, 50 + n) == [ALLOCATED]
        order += [i for i in range(8) if k(i) not in idx.entries and i not in order]
    assert order == [7, 6, 5, 4, 3, 2, 1, 0]


def test_balanced_mode_sends_the_t2_blocks_its_search_passes_back_to_t1():
    idx = make(slots=4, mode=BALANCED)
    request(idx, 0, 1, 2)
    request(idx, 0, 1, 2)  # T2, least recent
    request(idx, 10)  # T1, most recent
    assert idx.policy.seen_again == 3
    request(idx, 20)  # T1 over p = 0: the search passes 2, 1, 0 to reach 10
    assert set(idx.entries) == {k(0), k(1), k(2), k(20)}
    assert idx.policy.seen_again == 0, "the passed T2 blocks went back to T1"
    assert list(seg(idx).lru)[:3] == [k(2), k(1), k(0)]  # in their order, tail first
    request(idx, 21)  # the chain's tail is now T1's least recent
    assert set(idx.entries) == {k(0), k(1), k(20), k(21)}
    idx.check_integrity()


@pytest.mark.parametrize("mode", [RECENCY, BALANCED, FREQUENCY])
def test_each_shadow_plays_its_mode_as_the_index_does(mode: int):
    """The duel is only as good as its shadows: a shadow of the index's size, fed every key, earns
    what the index pinned in its mode earns (recency exactly; the others within 15 %: the
    frequency shadow keeps its own counts, and puts land after the reads in the index), on a
    mix of hot single blocks, shared chains and one-time scans."""
    rng = random.Random(3)
    idx = make(slots=300, mode=mode)
    shadow = du.Duel().shadows[mode]
    shadow.capacity = 300
    fresh = 10**6
    got_index = got_shadow = 0
    for _ in range(3000):
        x = rng.random()
        if x < 0.4:
            ids: tuple[int, ...] = (5000 + rng.randrange(200),)
        elif x < 0.7:
            c = rng.randrange(30)
            ids = tuple(range(7000 + 100 * c, 7000 + 100 * c + rng.randrange(1, 20)))
        else:
            fresh += 40
            ids = tuple(range(fresh, fresh + 40))
        got_index += request(idx, *ids, check=False)
        got_shadow += shadow.access([k(i) for i in ids])
    if mode == RECENCY:
        assert got_shadow == got_index
    else:
        assert abs(got_shadow - got_index) <= 0.15 * got_index, (got_shadow, got_index)
    idx.check_integrity()


def test_ghosts_are_bounded():
    idx = make(slots=4, mode=BALANCED)
    for i in range(3 * pol.MIN_POPULATION):
        request(idx, 10_000 + i, check=False)
    assert len(idx.policy.ghosts) == pol.MIN_POPULATION
    idx.check_integrity()


@pytest.mark.parametrize("seed", [1, 2])
def test_deferred_accounting_makes_every_decision_the_same(seed: int):
    """The service queues reads' accounting and drains it after answering (policy.defer): with
    drains at random points, the same traffic must keep the same blocks, decline the same puts
    and end in the same policy state as accounting at once, through mode switches, evictions,
    removals and SSD-less admission."""
    now, later = make(slots=300), make(slots=300)
    later.policy.defer = True
    rng, drains = random.Random(seed), random.Random(seed + 100)
    fresh = 10**6
    queued = 0
    for step in range(1500):
        if rng.random() < 0.5:
            ids = (5000 + rng.randrange(150),)
        else:
            fresh += 30
            ids = tuple(range(fresh, fresh + 30))
        assert read(now, *ids) == read(later, *ids)
        queued += bool(later.policy._pending)
        if drains.random() < 0.3:
            later.policy.drain()
        assert store(now, *ids, check=False) == store(later, *ids, check=False)
        if step % 97 == 0:
            victim = pk(5000 + rng.randrange(150))
            assert now.remove(victim) == later.remove(victim)
    assert queued > 1000, "reads were not queued: the test did not defer"
    later.policy.drain()
    assert now.policy.stats() == later.policy.stats()
    assert set(now.entries) == set(later.entries)
    assert now.policy.mode_switches > 0, "the traffic never switched modes: the test shows too little"
    later.check_integrity()
