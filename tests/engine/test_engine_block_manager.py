"""BlockManager bookkeeping: reference counts, the LRU free list, prefix-cache hits and their
token check, and the integrity check. Pure Python: runs without torch."""

from __future__ import annotations

import pytest
from engine_testlib import single_threaded_torch  # noqa: F401

from engine.block_manager import BlockManager, NoFreeBlocks
from kvstore.keys import KeySpace, ModelFingerprint

BS = 4
KS = KeySpace(ModelFingerprint("bm-test", "float32", 2, 2, 8, block_size=BS))


def _cache_all(bm: BlockManager, table: list[int], tokens: list[int]) -> list[bytes]:
    keys = KS.block_keys(tokens)
    for i, key in enumerate(keys):
        bm.cache_block(table[i], key, tokens[i * BS : (i + 1) * BS])
    return keys


def test_allocate_free_and_ref_counts():
    bm = BlockManager(8, BS)
    a = bm.allocate(3)
    assert a == [0, 1, 2] and bm.num_free_blocks == 5
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    b = bm.allocate(1, prefix=a[:2])  # shares two blocks
    assert b == [0, 1, 3] and bm.ref_count(0) == 2
    bm.check_integrity([a, b])
    bm.free(a)
    assert bm.ref_count(0) == 1 and bm.ref_count(2) == 0 and bm.num_free_blocks == 5
    bm.check_integrity([b])
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_integrity([])
    with pytest.raises(ValueError, match="freed more often"):
        bm.free([0])


def test_allocation_is_all_or_nothing():
    bm = BlockManager(4, BS)
    held = bm.allocate(3)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(2)
    assert bm.num_free_blocks == 1
    bm.check_integrity([held])


def test_prefix_hit_is_checked_against_stored_tokens():
    bm = BlockManager(8, BS)
    tokens = list(range(10))  # two full blocks + 2 tokens
    table = bm.allocate(3)
    keys = _cache_all(bm, table, tokens)
    assert len(keys) == 2 and bm.num_cached_blocks == 2
    assert bm.match_prefix(keys, tokens) == table[:2]
    assert bm.match_prefix(keys, tokens[:4] + [99] * 4) == table[:1]  # a forged key collision
    assert bm.match_prefix(KS.block_keys([5] + tokens[1:8]), [5] + tokens[1:8]) == []
    assert BlockManager(8, BS, enable_caching=False).match_prefix(keys, tokens) == []


def test_only_full_blocks_are_cached_and_first_registration_wins():
    bm = BlockManager(8, BS)
    a, b = bm.allocate(1), bm.allocate(1)
    key = KS.block_keys([1, 2, 3, 4])[0]
    with pytest.raises(ValueError, match="full blocks"):
        bm.cache_block(a[0], key, [1, 2, 3])
    assert bm.cache_block(a[0], key, [1, 2, 3, 4])
    assert not bm.cache_block(b[0], key, [1, 2, 3, 4])  # same block computed twice at once
    assert bm.match_prefix([key], [1, 2, 3, 4]) == a
    bm.check_integrity([a, b])


def test_freed_cached_blocks_stay_findable_until_lru_eviction():
    bm = BlockManager(6, BS)
    old, new = list(range(8)), list(range(100, 108))
    t_old = bm.allocate(2)
    k_old = _cache_all(bm, t_old, old)
    t_new = bm.allocate(2)
    k_new = _cache_all(bm, t_new, new)
    scratch = bm.allocate(2)  # nothing cacheable
    bm.free(t_old)  # freed first: least recently used
    bm.free(t_new)
    bm.free(scratch)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    # a hit revives a free cached block: it leaves the free list, nothing is evicted
    revived = bm.allocate(0, prefix=bm.match_prefix(k_new, new))
    assert revived == t_new and bm.num_free_blocks == 4 and bm.num_cached_blocks == 4
    bm.free(revived)  # now t_new is the most recently freed
    # uncached blocks are handed out first, then the least recently freed cached ones,
    # and of one chain the tail goes before the head
    got = bm.allocate(3)
    assert got[:2] == scratch
    assert got[2] == t_old[1]
    assert bm.match_prefix(k_old, old) == t_old[:1]  # the head survived its tail
    assert bm.match_prefix(k_new, new) == t_new
    assert bm.num_evictions == 1
    bm.check_integrity([got])


def test_reset_prefix_cache_drops_only_unused_blocks():
    bm = BlockManager(4, BS)
    a = bm.allocate(1)
    _cache_all(bm, a, [1, 2, 3, 4])
    b = bm.allocate(1)
    _cache_all(bm, b, [5, 6, 7, 8])
    bm.free(b)
    assert bm.reset_prefix_cache() == 1
    assert bm.num_cached_blocks == 1 and bm.is_cached(a[0]) and not bm.is_cached(b[0])
    bm.check_integrity([a])


def test_check_integrity_names_the_broken_equation():
    bm = BlockManager(4, BS)
    t = bm.allocate(2)
    with pytest.raises(AssertionError, match="ref count 1 but 0 live tables"):
        bm.check_integrity([t[:1]])
    bm._ref[3] = 1  # a block in use that is still in the free list
    with pytest.raises(AssertionError, match="num_blocks 4 != free 2 \\+ in use 3"):
        bm.check_integrity()


def test_cache_events_follow_the_prefix_cache_in_order():
    from collections import deque

    bm = BlockManager(num_blocks=2, block_size=2)
    bm.events = deque()
    a, b = bm.allocate(2)
    assert bm.cache_block(a, b"k" * 16, [1, 2]) and bm.cache_block(b, b"j" * 16, [3, 4])
    assert not bm.cache_block(b, b"j" * 16, [3, 4])  # not taken twice: no event
    bm.free([a, b])
    bm.allocate(1)  # takes a's block (freed last-first, so the tail b goes first)
    assert list(bm.events) == [(True, b"k" * 16), (True, b"j" * 16), (False, b"j" * 16)]
    assert bm.reset_prefix_cache() == 1
    assert bm.events[-1] == (False, b"k" * 16)
