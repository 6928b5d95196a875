"""The index's cache policy (kvstore.meta.policy) driven through the real index: the invariants
of the frequency mode (never evicts what is leased, pinned or being written; a chain's tail
before its head; admission in chain order; bounded history), the mode choice and its shadows
(kvstore.meta.duel), and aging. Every index check also checks the policy's own accounting."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.errors import ResourceExhausted
from kvstore.extent import ALIGN
from kvstore.meta import duel as du
from kvstore.meta.duel import FREQUENCY, RECENCY, SECOND_CHANCE
from kvstore.meta.index import Index, IndexLimits, PolicyParams, PutStatus
from kvstore.meta.table import LIVE, words
from tests.unit.test_index import BLK, FakeClock, dspec, k, pk, seg

ALLOCATED = PutStatus.ALLOCATED
NOT_ADMITTED = PutStatus.NOT_ADMITTED


def stored(idx: Index) -> set[bytes]:
    """The keys in the index (committed or being written)."""
    t = idx.table
    return {t.key(int(r)) for r in np.flatnonzero(t.flags[: t.n_rows] & LIVE)}


P = PolicyParams()


def recency(idx) -> list[bytes]:  # noqa: ANN001
    """The keys of the segment's evictable blocks, least recently used first."""
    return [idx.table.key(int(r)) for r in idx.table.oldest_batch(seg(idx).ref, 1 << 20)]


def demotions(idx, n: int) -> list[bytes]:  # noqa: ANN001
    """The keys the policy demotes first, as many as ``n`` blocks' extents."""
    return [idx.table.key(r) for r in idx.policy.demotion_order(seg(idx).ref, n * ALIGN)]


def mark(idx, key: bytes, spell: int) -> None:  # noqa: ANN001
    idx.table.again[int(idx.table.find(words(key))[0])] = spell


def make(slots: int = 8, policy: str = "adaptive", frequency: bool | None = None, mode: int | None = None) -> Index:
    idx = Index(IndexLimits(cache_policy=policy), FakeClock())
    idx.register_daemon(dspec(slots=slots), {})
    if frequency is not None:
        mode = FREQUENCY if frequency else RECENCY
    if mode is not None:
        # Pin the mode: these tests are about what each mode does.
        idx.policy.duel.mode = mode
        idx.policy.duel.decide = lambda *args: None  # type: ignore[method-assign]
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
    idx = make(slots=4, frequency=True)
    for _ in range(3):
        request(idx, 0, 1, 2, 3)  # a hot chain fills the segment, counted 3 times
    # A new chain seen once: colder than anything it would evict, so it is declined, in chain
    # order, and that is not an error.
    read(idx, 10, 11)
    assert store(idx, 10, 11) == [NOT_ADMITTED, NOT_ADMITTED]
    assert k(10) not in stored(idx) and read(idx, 0, 1, 2, 3) == 4
    assert idx.counters["not_admitted_keys"] == 2 and idx.counters["evictions"] == 0
    # Seen often enough, it earns its place: it displaces the least counted block, which is
    # the hot chain's tail (its head is counted as often, and more recent).
    for _ in range(5):
        read(idx, 10)
    assert store(idx, 10) == [ALLOCATED]
    assert k(3) not in stored(idx) and read(idx, 0, 1, 2) == 3


def test_lru_mode_and_lru_policy_admit_everything():
    for idx in (make(slots=4, policy="lru"), make(slots=4, frequency=False)):
        for _ in range(3):
            request(idx, 0, 1, 2, 3)
        read(idx, 10, 11)
        assert store(idx, 10, 11) == [ALLOCATED, ALLOCATED]
        assert read(idx, 0, 1) == 2 and read(idx, 2) == 0  # the chain's tail went first


def test_a_declined_block_stops_the_rest_of_the_put():
    idx = make(slots=4, frequency=True)
    for _ in range(2):
        request(idx, 0, 1, 2, 3)
    for _ in range(4):
        read(idx, 20, 21)  # 20 and 21 are hot, 22 is not
    read(idx, 22)
    st = store(idx, 22, 20, 21)
    assert st == [NOT_ADMITTED, NOT_ADMITTED, NOT_ADMITTED]


@pytest.mark.parametrize("mode", [RECENCY, FREQUENCY, SECOND_CHANCE])
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
        assert protected <= stored(idx), f"step {i}: a protected block was evicted"
        idx.check_integrity()
    idx.release(lease.lease_id)
    if pending.status == [ALLOCATED]:
        idx.put_abort(pending.put_id)
    idx.check_integrity()


def test_frequency_mode_takes_a_chain_tail_before_its_head():
    idx = make(slots=8, frequency=True)
    request(idx, 0, 1, 2, 3, 4, 5, 6, 7)
    request(idx, 0, 1, 2, 3, 4, 5, 6, 7)
    order = []
    for n in range(8):  # a hotter block each time displaces one block
        for _ in range(4 + n):
            read(idx, 50 + n)
        assert store(idx, 50 + n) == [ALLOCATED]
        order += [i for i in range(8) if k(i) not in stored(idx) and i not in order]
    assert order == [7, 6, 5, 4, 3, 2, 1, 0]


def test_demotion_order_follows_the_mode():
    idx = make(slots=8, frequency=True)
    request(idx, 0, 1, 2)
    for _ in range(5):
        read(idx, 0)
    read(idx, 1)
    assert recency(idx) == [k(2), k(0), k(1)]  # least recent first
    assert demotions(idx, 3) == [k(2), k(1), k(0)]  # least counted first
    idx.policy.duel.mode = RECENCY
    assert demotions(idx, 2) == [k(2), k(0)]


def test_history_is_bounded():
    idx = make(slots=4)
    limit = P.history_factor * P.min_population
    for i in range(0, 3 * limit, 64):
        idx.acquire(b"".join((10**6 + j).to_bytes(16, "big") for j in range(i, i + 64)))
        assert len(idx.policy.history) <= limit
    assert len(idx.policy.history) == limit
    # The shadows are bounded too.
    lru, lfu, sc = idx.policy.duel.shadows
    assert len(sc.d) <= sc.capacity
    assert len(lru.d) <= lru.capacity
    assert len(lfu.d) <= lfu.capacity
    assert len(lfu.history) <= P.history_factor * lfu.capacity


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
    assert k(0) not in stored(idx) and idx.policy.count(k(0)) == 4
    store(idx, 0)
    assert idx.policy.count(k(0)) == 4


def test_epochs_advance_with_accesses():
    idx = make(slots=4)
    before = idx.policy.epoch
    period = P.age_factor * P.min_population
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
    d.free = False
    assert d.mode == RECENCY
    d.choose(100.0, 110.0)  # 10 more hits: within 2 standard deviations (2 * sqrt(210) = 29)
    assert d.mode == RECENCY and d.switches == 0
    d.choose(100.0, 200.0)  # 100 more: significant, and above the margin
    assert d.mode == FREQUENCY and d.switches == 1
    d.choose(110.0, 100.0)  # recency ahead by noise only: stays
    assert d.mode == FREQUENCY and d.switches == 1
    d.choose(200.0, 100.0)
    assert d.mode == RECENCY and d.switches == 2
    d.choose(10_000.0, 10_050.0)  # significant at this volume (2 * sqrt(20050) = 283)? no: 50 < 283
    assert d.mode == RECENCY
    d.choose(10_000.0, 11_000.0)  # 1000 > 290 and 10 % > the 5 % margin
    assert d.mode == FREQUENCY and d.switches == 3
    # Back to recency takes the same margin: 400 more hits pass the noise (2 * sqrt(20400) =
    # 286) but are 4 % of frequency's, under the margin: stays.
    d.choose(10_400.0, 10_000.0)
    assert d.mode == FREQUENCY and d.switches == 3
    d.choose(10_600.0, 10_000.0)  # 6 %, and 600 > 2 * sqrt(20600) = 287
    assert d.mode == RECENCY and d.switches == 4
    # Weighed counts carry the raw counts' noise, scaled: 400 more of 6000 (7 %), from 5000 raw
    # hits weighed by 1.2 (noise 2 * 1.2 * sqrt(5000) = 170): significant; by 3 (noise 424): not.
    d.choose(6_000.0, 6_400.0, var=1.2**2 * 5000)
    assert d.mode == FREQUENCY and d.switches == 5
    d.choose(6_400.0, 6_000.0, var=3.0**2 * 5000)
    assert d.mode == FREQUENCY and d.switches == 5


def test_a_mode_that_does_not_deliver_what_its_shadow_promised_is_left():
    """The duel weighs each shadow's hits by what the index earned per shadow hit while in that
    mode: a frequency shadow that promises 10 % more than recency's, while the index in
    frequency mode earned about half of what the shadow counted, loses, and its promise does
    not bring the mode back; with no evidence of its own, or evidence that it over-delivers,
    the estimate is the shadow's, scaled as recency's."""
    d = du.Duel()
    assert d.calibration() == (1.0, 1.0, 1.0)
    d.free = False
    d.mode = FREQUENCY
    d.hits = [1000.0, 1100.0, 1000.0]
    d.decide()
    assert d.mode == FREQUENCY  # uncalibrated, the promise stands
    d.real = [0.0, 600.0, 0.0]
    d.shadowed = [0.0, 1100.0, 0.0]
    k_rec, k_freq, _ = d.calibration()
    assert k_rec == 1.0 and k_freq == pytest.approx((600 + P.prior_hits) / (1100 + P.prior_hits))
    d.decide()  # 1100 * 0.81 = 896, recency 12 % ahead and past the noise
    assert d.mode == RECENCY and d.switches == 1
    d.decide()
    assert d.mode == RECENCY and d.switches == 1, "re-entered on the same promise"
    d.real = [0.0, 2000.0, 0.0]  # the index in frequency mode earned more than its shadow counted
    assert d.calibration()[1] == d.calibration()[0], "a calibration may take back a promise, not make one"
    # Recency's ratio from evidence of its own: what the index earned over what its shadow counted.
    d.real = [3000.0, 600.0, 0.0]
    d.shadowed = [2400.0, 1100.0, 0.0]
    k_rec, k_freq, k_sc = d.calibration()
    assert k_sc == pytest.approx(k_rec), "no evidence of its own: recency's ratio"
    assert k_rec == pytest.approx((3000 + P.prior_hits) / (2400 + P.prior_hits))
    assert k_freq == pytest.approx((600 + k_rec * P.prior_hits) / (1100 + P.prior_hits))
    idx = make(slots=8)
    idx.policy.duel = d  # exported for the metrics, in thousandths
    st = idx.policy.stats()
    assert st["policy_recency_calibration_permille"] == round(1000 * k_rec)
    assert st["policy_frequency_calibration_permille"] == round(1000 * k_freq)


def test_the_index_own_hits_calibrate_the_mode_it_is_in():
    """``observe`` counts the index's own prefix hits on the sampled keys (all of them at a
    sample of 1 in 1) for the mode it is in, and nothing before the first eviction."""
    d = du.Duel()
    keys = [k(i) for i in range(10)]
    d.observe(keys, 100, 3)
    assert d.real == [0.0, 0.0, 0.0], "counted while free"
    d.free = False
    d.observe(keys, 100, 4)
    assert d.real[RECENCY] == pytest.approx(4.0, rel=0.01) and d.real[FREQUENCY] == 0.0
    assert d.shadowed[RECENCY] == pytest.approx(10.0, rel=0.01)  # the shadow holds all ten now
    # At 1 in s, only the sampled keys of the held run count.
    d = du.Duel()
    d.free = False
    indexed = 8 * P.shadow_blocks
    d.observe([k(0)], indexed, 0)  # sets s = 8
    assert d.s == 8
    keys = [k(i) for i in range(400)]
    d.real = [0.0, 0.0, 0.0]
    d.observe(keys, indexed, 150)
    want = sum(du.sampled(x, 8) for x in keys[:150])
    assert 0 < want < 150 and d.real[RECENCY] == pytest.approx(want, rel=0.01)


def test_the_index_reports_its_own_hits_to_the_duel():
    """``acquire`` and ``touch`` hand the policy the run the index held: the duel's calibration
    counts exactly those keys (1 in 1 at this size)."""
    idx = make(slots=8)
    store(idx, 1, 2, 3)
    idx.policy.duel.free = False
    idx.policy.duel.real = [0.0, 0.0, 0.0]
    read(idx, 1, 2, 3, 4, 5)  # 3 of 5 held
    assert idx.policy.duel.real[RECENCY] == pytest.approx(3.0, rel=0.01)
    idx.touch([pk(1, 2, 9)])  # 2 of 3 held
    assert idx.policy.duel.real[RECENCY] == pytest.approx(5.0, rel=0.01)


def test_shadows_start_over_when_the_index_doubles_not_at_every_crossing():
    d = du.Duel()
    b = 2 * P.shadow_blocks
    d.observe([k(0)], b, 0)
    assert d.s == 2
    shadows = d.shadows
    for i in range(20):  # hovering at the boundary
        d.observe([k(i)], b - (i % 2), 0)
    assert d.shadows is shadows and d.s == 2
    d.observe([k(0)], 4 * b, 0)  # doubled twice: up
    assert d.s == 8 and d.shadows is not shadows
    d.observe([k(0)], 2 * b - 1, 0)  # under half: stays
    assert d.s == 8
    d.observe([k(0)], b, 0)  # a quarter: down
    assert d.s == 2


def test_the_mode_is_free_until_the_first_eviction():
    """Before anything is evicted (or declined) both modes have stored the same blocks: the mode
    is what the rule for entering frequency mode says now, with no hysteresis; a lead the noise
    or the margin explains, or a tie, leaves (or puts back) the default recency mode, so that
    the index does not leave the free phase in a mode it would not have entered later. From
    then on, leaving frequency mode takes recency's margin."""
    d = du.Duel()
    assert d.mode == RECENCY and d.free
    d.choose(100.0, 101.0)  # one hit ahead: noise
    assert d.mode == RECENCY and d.switches == 0
    d.choose(10_000.0, 10_400.0)  # significant (400 > 2 * sqrt(20400) = 286) but 4 %: under the margin
    assert d.mode == RECENCY and d.switches == 0
    d.choose(10_000.0, 10_600.0)  # 6 % and significant: enters
    assert d.mode == FREQUENCY and d.switches == 1
    d.choose(10_000.0, 10_400.0)  # the lead under the margin again: back, free of charge
    assert d.mode == RECENCY and d.switches == 2
    d.choose(10_000.0, 10_600.0)
    d.free = False
    d.choose(10_000.0, 10_000.0)  # now a switch costs: frequency stays until recency clearly earns more
    assert d.mode == FREQUENCY and d.switches == 3
    idx = make(slots=8)
    for i in range(8):
        request(idx, i)
    assert idx.policy.duel.free, "nothing was evicted yet"
    request(idx, 100)
    assert not idx.policy.duel.free


@pytest.mark.parametrize("mode", [RECENCY, FREQUENCY, SECOND_CHANCE])
def test_each_shadow_plays_its_mode_as_the_index_does(mode: int):
    """The duel is only as good as its shadows: a shadow of the index's size, fed every key, earns
    what the index pinned in its mode earns (recency exactly; second chance within 2 %; frequency
    within 15 %: its shadow keeps its own counts, over a history of its own size), on a mix of hot
    single blocks, shared chains and one-time scans."""
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
    elif mode == SECOND_CHANCE:
        # The index reorders a request's hits as it leases and releases them, before the put;
        # the shadow touches hits and new blocks in one tail-first pass.
        assert abs(got_shadow - got_index) <= 0.02 * got_index, (got_shadow, got_index)
    else:
        assert abs(got_shadow - got_index) <= 0.15 * got_index, (got_shadow, got_index)
    idx.check_integrity()


@pytest.mark.parametrize("layout", ["big-endian counter", "little-endian counter", "tenant tag at the end"])
def test_the_shadow_sample_is_even_for_structured_keys(layout: str):
    """Shadows replay 1 in s keys. Clients may name blocks as they like, not only by hashes: with
    keys that are counters or carry a tenant tag, every chain position must still be sampled at
    about 1 in s, or the shadows see the same positions of every chain (a sample taken from a
    key's last bytes takes all of them or none, and chose the wrong mode on the trace)."""
    n = 40_000

    def key(i: int) -> bytes:
        if layout == "big-endian counter":
            return i.to_bytes(16, "big")
        if layout == "little-endian counter":
            return i.to_bytes(16, "little")
        return i.to_bytes(12, "little") + b"tnt7"

    for s in (3, 4, 8):  # 1 in s at every position, s a power of two or not
        taken = [0] * 8
        for i in range(n):
            taken[i % 8] += du.sampled(key(i), s)
        shares = [t / (n / 8) * s for t in taken]
        assert all(0.75 < x < 1.25 for x in shares), (s, shares)
    # Threshold sampling: a sparser sample is part of a denser one, whatever the two rates
    # (a sample by remainders is not: 1 in 4 is no part of 1 in 3).
    assert all(du.sampled(key(i), 4) for i in range(n) if du.sampled(key(i), 8))
    assert all(du.sampled(key(i), 3) for i in range(n) if du.sampled(key(i), 4))
    assert all(du.sampled(key(i), 1) for i in range(100))


def test_a_request_longer_than_the_recency_shadow_keeps_its_head():
    shadow = du.ShadowLru(4)
    chain = [k(i) for i in range(10)]
    shadow.access(chain)
    assert list(shadow.d) == chain[3::-1]  # the head, touched last, most recent
    assert shadow.access(chain) == 4


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
    assert stored(now) == stored(later)
    assert now.policy.mode_switches > 0, "the traffic never switched modes: the test shows too little"
    later.check_integrity()


@pytest.mark.parametrize("setup", ["lru", "recency", "frequency", "second_chance", "switching", "adaptive"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_block_outlives_its_parent(setup: str, seed: int):
    """A chain's tail goes before its head in every mode, also under reads of a prefix only and
    requests that share a head and fork: after every step, each stored block's parent is stored
    (a block without its predecessors can never be a prefix hit, so keeping it would waste the
    room)."""
    rng = random.Random(seed)
    if setup == "lru":
        idx = make(slots=40, policy="lru")
    elif setup == "adaptive":
        idx = make(slots=40)
    elif setup == "switching":  # the mode changes at random, as often as every request
        idx = make(slots=40, mode=RECENCY)
        duel, modes = idx.policy.duel, random.Random(seed + 7)

        def decide() -> None:
            if modes.random() < 0.2:
                duel.mode = modes.choice((RECENCY, FREQUENCY, SECOND_CHANCE))

        duel.decide = decide  # type: ignore[method-assign]
    else:
        idx = make(slots=40, mode=du.MODES.index(setup))
    parent: dict[int, int] = {}
    chains: list[list[int]] = []
    fresh = 1000
    for _ in range(40):  # a forest: shared heads, forks, private tails
        if chains and rng.random() < 0.6:
            base = rng.choice(chains)
            chain = base[: rng.randrange(1, len(base) + 1)]
        else:
            chain = []
        for _ in range(rng.randrange(1, 12)):
            fresh += 1
            if chain:
                parent[fresh] = chain[-1]
            chain = chain + [fresh]
        chains.append(chain)
    weights = [1 / (i + 1) for i in range(len(chains))]  # some chains hot, most cold
    for step in range(600):
        chain = rng.choices(chains, weights)[0]
        if rng.random() < 0.3:
            read(idx, *chain[: rng.randrange(1, len(chain) + 1)])  # a prefix only
        else:
            try:
                request(idx, *chain, check=False)
            except Exception as e:  # the whole segment leased or written: nothing to evict
                assert type(e).__name__ == "ResourceExhausted", e
        held = {int.from_bytes(x, "big") - 1 for x in stored(idx)}  # k(i) is i + 1
        orphans = [b for b in held if b in parent and parent[b] not in held]
        assert not orphans, f"step {step}: {orphans} stored without their parents"
    assert idx.counters["evictions"] > 30, "the test evicted too little to show anything"
    idx.check_integrity()


def test_second_chance_mode_passes_over_blocks_read_again():
    """In second-chance mode a block read again since it was stored gets one more pass when it
    is the least recent: it loses the mark and goes to the most recent end; the least recent
    unmarked block goes instead."""
    idx = make(slots=3, mode=SECOND_CHANCE)
    for i in range(3):
        request(idx, i)
    assert read(idx, 0) == 1  # 0 read again: marked (and the most recent)
    request(idx, 1)  # 1 read again too: order 2, 0, 1
    request(idx, 2)  # and 2: every block marked, order 0, 1, 2
    request(idx, 10)  # all marked: each passed over in turn, then the least recent (0) goes
    assert k(0) not in stored(idx) and {k(1), k(2), k(10)} <= stored(idx)
    assert read(idx, 2) == 1  # 2 marked again; 1 is unmarked now
    request(idx, 11)  # 1 is the least recent and unmarked: it goes
    assert k(1) not in stored(idx) and {k(2), k(10), k(11)} <= stored(idx)
    request(idx, 12)  # order 10, 2, 11: 10 unmarked goes, 2 keeps its mark
    assert k(10) not in stored(idx)
    request(idx, 13)  # order 2 (marked), 11, 12: 2 passed over, 11 goes
    assert k(11) not in stored(idx) and k(2) in stored(idx)
    idx.check_integrity()
    # In recency mode the same traffic keeps nothing read again beyond its turn.
    lru = make(slots=3, frequency=False)
    for i in range(3):
        request(lru, i)
    read(lru, 0)
    request(lru, 1)
    request(lru, 2)
    request(lru, 10)
    assert k(0) not in stored(lru)


def test_marks_of_an_earlier_spell_do_not_count():
    """Marks are set only in second-chance mode, and a new spell of it starts with none: an
    eviction never walks over marks left from before."""
    idx = make(slots=3, mode=RECENCY)
    for i in range(3):
        request(idx, i)
    for i in range(3):
        read(idx, i)  # read again in recency mode: not marked
    idx.policy.duel.mode = SECOND_CHANCE
    request(idx, 10)
    assert k(0) not in stored(idx), "a read in recency mode counted as a mark"
    mark(idx, k(1), idx.policy._spell)  # order 1, 2, 10: the least recent marked
    idx.policy._spell += 1  # a later spell
    request(idx, 11)
    assert k(1) not in stored(idx), "a mark of an earlier spell counted"


def test_second_chance_demotes_blocks_not_read_again_first():
    idx = make(slots=8, mode=SECOND_CHANCE)
    request(idx, 0)
    request(idx, 1)
    request(idx, 2)
    read(idx, 0)  # read again: marked
    read(idx, 1)  # read again: marked
    assert recency(idx) == [k(2), k(0), k(1)]
    assert demotions(idx, 2) == [k(2), k(0)]  # unmarked first, then the least recent marked


def test_the_recency_family_member_switches_on_a_paired_difference():
    """Second chance and plain recency see the same sampled requests and keep nearly the same
    blocks: the duel picks between them on the noise of their paired difference (the decayed
    sum of squared per-request differences), with no margin; the frequency duel is unchanged."""
    d = du.Duel()
    d.free = False
    d.hits = [10_000.0, 0.0, 10_150.0]  # 1.5 % more: far under the margin the frequency duel needs
    d.paired = 100.0**2  # noise 2 * 100: not past it
    d.decide()
    assert d.mode == RECENCY and d.variant == RECENCY and d.switches == 0
    d.paired = 60.0**2  # noise 120 < 150: past it
    d.decide()
    assert d.mode == SECOND_CHANCE and d.variant == SECOND_CHANCE and d.switches == 1
    d.hits = [10_100.0, 0.0, 10_000.0]  # recency 100 ahead, under the noise: stays
    d.decide()
    assert d.mode == SECOND_CHANCE
    d.hits = [10_200.0, 0.0, 10_000.0]
    d.decide()
    assert d.mode == RECENCY and d.switches == 2
    # Frequency mode against the member in use, with the margin; the member keeps being chosen
    # meanwhile, and the index returns to the member chosen last.
    d.hits = [10_000.0, 20_000.0, 10_200.0]
    d.decide()
    assert d.mode == FREQUENCY and d.variant == SECOND_CHANCE and d.switches == 3
    d.hits = [10_000.0, 5_000.0, 10_200.0]
    d.decide()
    assert d.mode == SECOND_CHANCE and d.switches == 4
    # The shadows feed the paired sum: a request where they differ adds its difference squared.
    d = du.Duel()
    d.observe([k(i) for i in range(5)], 100, 0)
    assert d.paired == 0.0
    d.shadows[RECENCY].d.clear()  # recency's shadow forgets; second chance's still holds them
    d.observe([k(i) for i in range(5)], 100, 0)
    assert d.paired == pytest.approx(25.0, rel=0.01)


@pytest.mark.parametrize("after", [RECENCY, FREQUENCY, SECOND_CHANCE])
def test_leaving_second_chance_keeps_chain_order(after: int):
    """Within a spell a block passed over goes to the most recent end without its predecessor,
    which only its mark keeps; as the spell ends, still-marked blocks go to the most recent end,
    so no mode that ignores the marks (nor a later spell) takes the predecessor first."""
    idx = make(slots=4, mode=SECOND_CHANCE)
    duel = idx.policy.duel
    request(idx, 0, 1)  # chain 0 -> 1
    read(idx, 0, 1)  # both marked, order 1, 0
    request(idx, 10)
    read(idx, 0)  # a prefix-only read: order 1, 10, 0
    request(idx, 11)
    request(idx, 12)  # 1 passed over (after 0 now, unmarked), 10 goes: order 0, 11, 1, 12
    assert k(10) not in stored(idx) and recency(idx)[0] == k(0)
    going = [RECENCY] + ([SECOND_CHANCE] if after == SECOND_CHANCE else [])
    duel.decide = lambda: setattr(duel, "mode", going[0])  # type: ignore[method-assign]
    read(idx, 99)  # the spell ends
    if after == SECOND_CHANCE:
        going.pop(0)
        read(idx, 98)  # and a new one starts: the old marks count for nothing
    duel.mode = after
    assert recency(idx)[-1] == k(0), "the marked predecessor did not go to the most recent end"
    request(idx, 13)
    assert k(1) not in stored(idx) or k(0) in stored(idx), "1 stored without 0"
    idx.check_integrity()


def test_a_put_with_nothing_evictable_leaves_the_mode_free():
    """Until the index first evicts, the mode is free to follow the evidence (the duel's
    ``free``); a put that finds nothing it may evict (all being written) evicts nothing."""
    idx = make(slots=2)
    r = idx.put_start(pk(0, 1), [BLK, BLK])  # both slots being written
    with pytest.raises(ResourceExhausted):
        idx.put_start(pk(5), [BLK])
    assert idx.policy.duel.free
    idx.put_commit(r.put_id, [7, 7])
    store(idx, 6)  # evicts: the mode is no longer free
    assert not idx.policy.duel.free
