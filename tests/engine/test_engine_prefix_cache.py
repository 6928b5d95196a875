"""The local prefix cache inside the engine: shared prefixes reuse blocks (counted), outputs do
not change, blocks come back, and freed cached blocks are reused in LRU order."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine_testlib import greedy_reference, make_engine, single_threaded_torch  # noqa: E402, F401

BS = 16
PREFIX = [(5 * i + 3) % 256 for i in range(3 * BS)]  # three full blocks
A = PREFIX + [1, 2, 3]
B = PREFIX + [9, 8, 7, 6, 5]


def _all_free(engine) -> None:
    engine.check_integrity()
    bm = engine.block_manager
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    assert bm.num_free_blocks == bm.num_blocks


def test_second_request_reuses_the_shared_prefix():
    engine = make_engine()
    out_a = engine.generate([A], max_tokens=12, ignore_eos=True)
    assert engine.stats.cached_tokens == 0
    cached_before = engine.block_manager.num_cached_blocks
    assert cached_before >= 3
    out_b = engine.generate([B], max_tokens=12, ignore_eos=True)
    assert engine.stats.cached_tokens == len(PREFIX)  # three blocks reused
    assert engine.stats.prefill_tokens == len(A) + len(B) - len(PREFIX)
    plain = make_engine(enable_prefix_caching=False)
    assert plain.generate([A, B], max_tokens=12, ignore_eos=True) == out_a + out_b
    assert plain.block_manager.num_cached_blocks == 0 and plain.stats.cached_tokens == 0
    assert out_b == [greedy_reference(B, 12)]
    _all_free(engine)
    assert engine.block_manager.num_cached_blocks >= cached_before  # still there for the next hit


def test_running_requests_share_blocks_by_reference():
    engine = make_engine()
    a = engine.add_request(A, max_tokens=8, ignore_eos=True)
    engine.step()  # prefills A: its three prompt blocks are now cached
    b = engine.add_request(B, max_tokens=8, ignore_eos=True)
    engine.step()  # admits and prefills B on top of A's blocks
    seq_a, seq_b = engine.scheduler.running
    assert (seq_a.request_id, seq_b.request_id) == (a, b)
    assert seq_b.block_table[:3] == seq_a.block_table[:3]
    assert seq_b.block_table[3] != seq_a.block_table[3]
    assert [engine.block_manager.ref_count(x) for x in seq_a.block_table[:4]] == [2, 2, 2, 1]
    assert seq_b.num_cached_tokens == len(PREFIX)
    engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
    _all_free(engine)


def test_a_fully_cached_prompt_still_computes_its_last_block():
    prompt = PREFIX[: 2 * BS]
    engine = make_engine()
    first = engine.generate([prompt], max_tokens=6, ignore_eos=True)
    second = engine.generate([prompt], max_tokens=6, ignore_eos=True)
    assert first == second == [greedy_reference(prompt, 6)]
    assert engine.stats.cached_tokens == BS  # not 2 * BS: the last token needs its logits
    _all_free(engine)


def test_blocks_completed_during_decode_are_cached_for_the_next_turn():
    engine = make_engine()
    prompt = PREFIX[:20]
    (out,) = engine.generate([prompt], max_tokens=30, ignore_eos=True)  # 49 tokens get KV: 3 full blocks
    turn2 = prompt + out[:29] + [7]  # the conversation continues
    (out2,) = engine.generate([turn2], max_tokens=5, ignore_eos=True)
    assert engine.stats.cached_tokens == 3 * BS
    assert out2 == greedy_reference(turn2, 5)
    _all_free(engine)


def test_freed_cached_blocks_are_reused_in_lru_order():
    engine = make_engine(num_blocks=8)
    bm = engine.block_manager
    engine.generate([A], max_tokens=4, ignore_eos=True)  # 4 blocks, 3 of them cached, all freed
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 3
    other = [200 + i % 50 for i in range(20)]
    engine.generate([other], max_tokens=4, ignore_eos=True)  # takes uncached free blocks first
    assert bm.num_evictions == 0
    engine.generate([A], max_tokens=4, ignore_eos=True)
    assert engine.stats.cached_tokens == 3 * BS  # A's blocks survived in the free list
    big = [100 + i % 90 for i in range(8 * BS)]
    engine.generate([big], max_tokens=1, ignore_eos=True)  # needs every block: evicts all
    assert bm.num_evictions >= 3
    before = engine.stats.cached_tokens
    engine.generate([A], max_tokens=4, ignore_eos=True)
    assert engine.stats.cached_tokens == before  # nothing left to hit
    _all_free(engine)


def test_preemption_under_block_pressure_keeps_outputs():
    prompts = [[(11 * i + j) % 256 for j in range(20)] for i in range(4)]
    engine = make_engine(num_blocks=9)  # each request needs 4 blocks at the end; 4 x 4 > 9
    outs = engine.generate(prompts, max_tokens=40, ignore_eos=True)
    assert engine.stats.preemptions > 0
    assert outs == [greedy_reference(p, 40) for p in prompts]
    _all_free(engine)
