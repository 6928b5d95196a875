"""Unit tests for kvstore.meta.allocator.Allocator (pure Python, no I/O)."""

from __future__ import annotations

import random

import pytest

from kvstore.extent import ALIGN
from kvstore.meta.allocator import Allocator

A = ALIGN


def free_ranges(alloc: Allocator) -> list[tuple[int, int]]:
    """Free ranges as sorted (start, size) pairs."""
    return sorted(alloc._by_start.items())


# ---- basics -----------------------------------------------------------------------------------


def test_fresh_allocator_is_one_free_range():
    alloc = Allocator(8 * A)
    assert alloc.capacity == 8 * A
    assert alloc.used == 0
    assert alloc.free == 8 * A
    assert free_ranges(alloc) == [(0, 8 * A)]
    alloc.check_integrity()


def test_capacity_is_rounded_down_to_align():
    alloc = Allocator(3 * A + 100)
    assert alloc.capacity == 3 * A
    assert alloc.free == 3 * A
    assert alloc.alloc(3 * A) == 0
    assert alloc.alloc(A) is None
    alloc.check_integrity()


@pytest.mark.parametrize("capacity", [0, A - 1])
def test_capacity_below_align_has_no_space(capacity):
    alloc = Allocator(capacity)
    assert alloc.capacity == 0
    assert alloc.alloc(A) is None
    assert free_ranges(alloc) == []
    alloc.check_integrity()


@pytest.mark.parametrize("size", [0, -A, 1, A - 1, A + 1, 3 * A // 2])
def test_alloc_refuses_bad_sizes(size):
    alloc = Allocator(8 * A)
    with pytest.raises(ValueError, match="multiple of"):
        alloc.alloc(size)
    assert alloc.used == 0
    assert free_ranges(alloc) == [(0, 8 * A)]
    alloc.check_integrity()


def test_sequential_allocs_are_adjacent_and_disjoint():
    alloc = Allocator(8 * A)
    offs = [alloc.alloc(A) for _ in range(4)]
    assert offs == [0, A, 2 * A, 3 * A]
    assert alloc.used == 4 * A
    assert alloc.free == 4 * A
    assert free_ranges(alloc) == [(4 * A, 4 * A)]
    alloc.check_integrity()


def test_fill_exactly_then_out_of_space_returns_none():
    alloc = Allocator(4 * A)
    assert alloc.alloc(2 * A) == 0
    assert alloc.alloc(2 * A) == 2 * A
    assert alloc.free == 0
    assert alloc.alloc(A) is None
    assert alloc.used == 4 * A
    alloc.check_integrity()


def test_request_larger_than_capacity_returns_none_and_changes_nothing():
    alloc = Allocator(4 * A)
    assert alloc.alloc(5 * A) is None
    assert alloc.used == 0
    assert free_ranges(alloc) == [(0, 4 * A)]
    alloc.check_integrity()


def test_release_all_coalesces_back_to_one_range_in_any_order():
    rng = random.Random(7)
    for _ in range(20):
        alloc = Allocator(16 * A)
        extents = []
        while True:
            size = rng.choice([A, 2 * A, 3 * A])
            off = alloc.alloc(size)
            if off is None:
                break
            extents.append((off, size))
        rng.shuffle(extents)
        for off, size in extents:
            alloc.release(off, size)
            alloc.check_integrity()
        assert alloc.used == 0
        assert free_ranges(alloc) == [(0, 16 * A)]


def test_release_merges_with_previous_neighbour():
    alloc = Allocator(4 * A)
    a, b, c, d = (alloc.alloc(A) for _ in range(4))
    alloc.release(a, A)
    alloc.release(b, A)  # merges with a's range before it
    assert free_ranges(alloc) == [(0, 2 * A)]
    alloc.check_integrity()


def test_release_merges_with_next_neighbour():
    alloc = Allocator(4 * A)
    a, b, c, d = (alloc.alloc(A) for _ in range(4))
    alloc.release(c, A)
    alloc.release(b, A)  # merges with c's range after it
    assert free_ranges(alloc) == [(A, 2 * A)]
    alloc.check_integrity()


def test_release_merges_with_both_neighbours():
    alloc = Allocator(5 * A)
    offs = [alloc.alloc(A) for _ in range(5)]
    alloc.release(offs[1], A)
    alloc.release(offs[3], A)
    assert free_ranges(alloc) == [(A, A), (3 * A, A)]
    alloc.release(offs[2], A)
    assert free_ranges(alloc) == [(A, 3 * A)]
    assert alloc.used == 2 * A
    alloc.check_integrity()


def test_release_merges_with_trailing_free_space():
    alloc = Allocator(8 * A)
    a = alloc.alloc(2 * A)
    b = alloc.alloc(2 * A)
    alloc.release(b, 2 * A)
    assert free_ranges(alloc) == [(2 * A, 6 * A)]
    alloc.release(a, 2 * A)
    assert free_ranges(alloc) == [(0, 8 * A)]
    alloc.check_integrity()


# ---- reuse and fragmentation --------------------------------------------------------------------


def test_exact_size_free_range_is_reused():
    alloc = Allocator(16 * A)
    offs = [alloc.alloc(2 * A) for _ in range(4)]  # 0, 2A, 4A, 6A; free tail [8A, 16A)
    alloc.release(offs[1], 2 * A)
    # An exact-size hole exists: it must be taken rather than the bigger tail.
    assert alloc.alloc(2 * A) == offs[1]
    assert free_ranges(alloc) == [(8 * A, 8 * A)]
    alloc.check_integrity()


def test_smaller_request_takes_smallest_larger_range():
    alloc = Allocator(16 * A)
    offs = [alloc.alloc(3 * A) for _ in range(4)]  # 0, 3A, 6A, 9A; tail [12A, 16A) is 4A
    alloc.release(offs[1], 3 * A)  # hole of 3A at 3A
    # A 1A request: best fit is the 3A hole (smaller than the 4A tail); the remainder stays free.
    off = alloc.alloc(A)
    assert off == 3 * A
    assert free_ranges(alloc) == [(4 * A, 2 * A), (12 * A, 4 * A)]
    assert alloc.used == 10 * A
    alloc.check_integrity()


def test_larger_request_skips_too_small_hole():
    alloc = Allocator(10 * A)
    offs = [alloc.alloc(2 * A) for _ in range(4)]  # 0..8A; tail [8A, 10A)
    alloc.release(offs[1], 2 * A)  # hole of 2A at 2A
    # 3A fits neither the hole nor the tail.
    assert alloc.alloc(3 * A) is None
    assert alloc.used == 6 * A
    # 2A is served from a hole, leaving the other one.
    assert alloc.alloc(2 * A) in (2 * A, 8 * A)
    alloc.check_integrity()


def test_fragmented_free_space_cannot_serve_contiguous_request():
    alloc = Allocator(4 * A)
    offs = [alloc.alloc(A) for _ in range(4)]
    alloc.release(offs[0], A)
    alloc.release(offs[2], A)
    assert alloc.free == 2 * A
    assert alloc.alloc(2 * A) is None  # 2A free in total, but not contiguous
    alloc.release(offs[1], A)  # joins the two holes into [0, 3A)
    assert free_ranges(alloc) == [(0, 3 * A)]
    assert alloc.alloc(2 * A) == 0
    assert free_ranges(alloc) == [(2 * A, A)]
    alloc.check_integrity()


def test_freed_middle_then_larger_alloc_comes_from_tail():
    alloc = Allocator(12 * A)
    offs = [alloc.alloc(2 * A) for _ in range(3)]  # 0, 2A, 4A; tail [6A, 12A)
    alloc.release(offs[1], 2 * A)
    off = alloc.alloc(4 * A)
    assert off == 6 * A
    assert free_ranges(alloc) == [(2 * A, 2 * A), (10 * A, 2 * A)]
    alloc.check_integrity()


# ---- with_used (rebuild from inventory) -------------------------------------------------------


def test_with_used_accepts_disjoint_extents_and_builds_free_gaps():
    extents = [(4 * A, A), (0, 2 * A), (6 * A, 2 * A)]
    alloc, accepted = Allocator.with_used(10 * A, extents)
    assert accepted.tolist() == [True, True, True]
    assert alloc.capacity == 10 * A
    assert alloc.used == 5 * A
    assert free_ranges(alloc) == [(2 * A, 2 * A), (5 * A, A), (8 * A, 2 * A)]
    alloc.check_integrity()
    # The rebuilt allocator hands out only the gaps, and releases coalesce.
    assert alloc.alloc(2 * A) in (2 * A, 8 * A)
    alloc.release(4 * A, A)
    alloc.check_integrity()


def test_with_used_empty_inventory_is_all_free():
    alloc, accepted = Allocator.with_used(4 * A + 7, [])
    assert accepted.tolist() == []
    assert alloc.capacity == 4 * A
    assert free_ranges(alloc) == [(0, 4 * A)]
    alloc.check_integrity()


def test_with_used_full_inventory_has_no_free_range():
    alloc, accepted = Allocator.with_used(2 * A, [(0, A), (A, A)])
    assert accepted.tolist() == [True, True]
    assert alloc.free == 0
    assert free_ranges(alloc) == []
    assert alloc.alloc(A) is None
    alloc.check_integrity()


def test_with_used_refuses_overlap():
    alloc, accepted = Allocator.with_used(8 * A, [(0, 2 * A), (A, 2 * A), (2 * A, A)])
    assert accepted.tolist() == [True, False, True]
    assert alloc.used == 3 * A
    alloc.check_integrity()


def test_with_used_refuses_duplicate_start():
    alloc, accepted = Allocator.with_used(8 * A, [(2 * A, A), (2 * A, A)])
    assert accepted.tolist().count(True) == 1
    assert alloc.used == A
    alloc.check_integrity()


@pytest.mark.parametrize(
    "extent",
    [
        (1, A),  # misaligned start
        (A, A + 1),  # misaligned size
        (A, 0),  # empty
        (A, -A),  # negative size
        (-A, A),  # negative start
        (7 * A, 2 * A),  # runs past the end
        (8 * A, A),  # starts at the end
        (100 * A, A),  # far out of range
    ],
)
def test_with_used_refuses_misaligned_or_out_of_range(extent):
    alloc, accepted = Allocator.with_used(8 * A, [(0, A), extent, (3 * A, A)])
    assert accepted.tolist() == [True, False, True]
    assert alloc.used == 2 * A
    assert free_ranges(alloc) == [(A, 2 * A), (4 * A, 4 * A)]
    alloc.check_integrity()


def test_with_used_misaligned_capacity_bounds_extents():
    alloc, accepted = Allocator.with_used(4 * A + 10, [(3 * A, A), (4 * A, A)])
    assert alloc.capacity == 4 * A
    assert accepted.tolist() == [True, False]
    alloc.check_integrity()


# ---- check_integrity catches corruption ---------------------------------------------------------


def test_check_integrity_detects_accounting_error():
    alloc = Allocator(4 * A)
    alloc.alloc(A)
    alloc.used += A  # corrupt the accounting
    with pytest.raises(AssertionError):
        alloc.check_integrity()


def test_check_integrity_detects_uncoalesced_ranges():
    alloc = Allocator(4 * A)
    alloc._remove(0)
    alloc._add(0, 2 * A)
    alloc._add(2 * A, 2 * A)  # two adjacent free ranges: should have been merged
    with pytest.raises(AssertionError):
        alloc.check_integrity()


# ---- randomized against a reference model -----------------------------------------------------


def _largest_gap(used: dict[int, int], capacity: int) -> int:
    best = 0
    cursor = 0
    for start in sorted(used):
        best = max(best, start - cursor)
        cursor = start + used[start]
    return max(best, capacity - cursor)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomized_alloc_free_against_reference_model(seed):
    rng = random.Random(seed)
    capacity = 64 * A
    alloc = Allocator(capacity)
    used: dict[int, int] = {}  # reference model: start -> size of live extents
    for _ in range(1500):
        if used and (rng.random() < 0.45 or alloc.free == 0):
            start = rng.choice(list(used))
            alloc.release(start, used.pop(start))
        else:
            size = rng.choice([A, A, A, 2 * A, 3 * A, 5 * A, 8 * A])
            off = alloc.alloc(size)
            if off is None:
                # Free ranges are coalesced, so None means no gap of this size exists.
                assert _largest_gap(used, capacity) < size
            else:
                assert off % A == 0
                assert 0 <= off and off + size <= capacity
                for s, sz in used.items():
                    assert off + size <= s or s + sz <= off, f"overlap with [{s}, {s + sz})"
                used[off] = size
        assert alloc.used == sum(used.values())
        alloc.check_integrity()
        # Free ranges are exactly the complement of the used ranges.
        complement = []
        cursor = 0
        for s in sorted(used):
            if s > cursor:
                complement.append((cursor, s - cursor))
            cursor = s + used[s]
        if cursor < capacity:
            complement.append((cursor, capacity - cursor))
        assert free_ranges(alloc) == complement
    for s, sz in list(used.items()):
        alloc.release(s, sz)
    assert free_ranges(alloc) == [(0, capacity)]
    alloc.check_integrity()


# ---- alloc_run (a run of extents of one size) -------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_alloc_run_places_as_that_many_allocs_would(seed):
    """On allocators fragmented at random, a run of n extents lands where n calls of alloc()
    would put them (the same offsets, the same free ranges after), or nowhere if they do not all
    fit (nothing changed)."""
    import random

    rnd = random.Random(seed)
    cap = 512 * A
    a, b = Allocator(cap), Allocator(cap)
    held = []
    for _ in range(rnd.randint(0, 300)):
        size = rnd.choice((1, 1, 2, 3)) * A
        off = a.alloc(size)
        assert b.alloc(size) == off
        if off is not None:
            held.append((off, size))
    for off, size in rnd.sample(held, len(held) // 2):
        a.release(off, size)
        b.release(off, size)
    size = rnd.choice((1, 2, 3)) * A
    n = rnd.randint(1, 200)
    before = sorted(a._by_start.items())
    got = a.alloc_run(size, n)
    one_by_one = [b.alloc(size) for _ in range(n)]
    if None in one_by_one:
        assert got is None and sorted(a._by_start.items()) == before
    else:
        assert sorted(got.tolist()) == sorted(one_by_one)
        assert sorted(a._by_start.items()) == sorted(b._by_start.items()) and a.used == b.used
        a.check_integrity()
