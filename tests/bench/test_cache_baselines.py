"""The baseline policies of bench/cache_baselines.py on hand-made streams (each worked by hand
from its paper's rules) and their bounds on random streams."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.cache_baselines import ARC, BASELINES, LRU, S3FIFO, TailFirstLRU, replay  # noqa: E402
from bench.policy import Stream, optimal_hits  # noqa: E402


def hits(policy, requests):  # noqa: ANN001
    return [policy.request(r) for r in requests]


def test_lru_and_tail_first_lru_differ_on_a_chain():
    # Capacity 3. LRU touches [1,2,3] in order, so 1 is oldest; the next request [4] evicts 1
    # and the chain [1,2,3] has no prefix hit. Tail-first LRU touches 3,2,1: 3 goes, 1 2 stay.
    reqs = [[1, 2, 3], [4], [1, 2, 3]]
    assert hits(LRU(3), reqs) == [0, 0, 0]
    assert hits(TailFirstLRU(3), reqs) == [0, 0, 2]


def test_s3fifo_filters_one_time_blocks_and_recalls_ghosts():
    p = S3FIFO(10)  # small queue of 1, main of 9
    assert p.small_cap == 1
    p.request([1])
    p.request([1])  # accessed while in the small queue
    for b in range(100, 109):
        p.request([b])  # the cache is full now, everything in the small queue
    p.request([200])  # full: 1 leaves small for main (it was accessed), 100 leaves for the ghost
    assert 1 in p.main and 100 not in p and 100 in p.ghost
    p.request([100])  # a ghost hit goes straight to main
    assert 100 in p.main
    # One-time blocks pass through the small queue without touching main.
    for b in range(300, 400):
        p.request([b])
    assert 1 in p and 100 in p


def test_arc_adapts_its_target_on_ghost_hits():
    p = ARC(4)
    for b in (1, 2, 3, 4):
        p.request([b])
    p.request([1])  # 1 moves to T2
    assert 1 in p.t2 and p.p == 0
    p.request([5])  # evicts from T1 into B1
    evicted = next(iter(p.b1))
    p.request([evicted])  # a B1 hit: recency was short of room, p grows
    assert p.p > 0 and evicted in p.t2


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_capacity_is_never_exceeded_and_no_policy_beats_min(name: str):
    rng = random.Random(3)
    reqs = []
    for _ in range(400):
        root = rng.randrange(30)
        reqs.append([root * 1000 + i for i in range(rng.randrange(1, 12))])
    for cap in (1, 5, 20, 60):
        p = BASELINES[name](cap)
        total = 0
        for r in reqs:
            total += p.request(r)
            assert len(p) <= cap
        s = Stream.from_keys("r", [[i.to_bytes(16, "big") for i in r] for r in reqs])
        assert total <= optimal_hits(s.flat, s.offsets, cap)["hits"]
        assert replay(BASELINES[name](cap), reqs)["hits"] == total  # deterministic


def test_bad_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        LRU(0)
