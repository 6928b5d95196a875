"""The paged KV cache: greedy output does not depend on how a prompt is chunked, on batching, or
on where its blocks live, and equals a plain full-recompute reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine_testlib import greedy_reference, make_engine, single_threaded_torch, tiny_model  # noqa: E402, F401

from engine.attention import AttentionMetadata  # noqa: E402
from engine.errors import InvalidRequest  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402

BS = 16
LENGTHS = [1, BS - 1, BS, BS + 1, 3 * BS + 5]
MAX_TOKENS = 20  # crosses at least one block boundary during decode


def _prompt(n: int) -> list[int]:
    return [(7 * i + n) % 256 for i in range(n)]


@pytest.mark.parametrize("n", LENGTHS)
def test_chunking_does_not_change_greedy_output(n):
    prompt = _prompt(n)
    expected = greedy_reference(prompt, MAX_TOKENS)
    for chunk in (4096, 7, 1):  # one chunk, several chunks, token by token
        engine = make_engine(max_num_batched_tokens=chunk, enable_prefix_caching=False)
        assert engine.generate([prompt], max_tokens=MAX_TOKENS, ignore_eos=True) == [expected], f"chunk={chunk}"
        assert engine.stats.prefill_tokens == n
        engine.check_integrity()
        assert engine.block_manager.num_free_blocks == engine.config.num_blocks


def test_batched_requests_of_mixed_lengths_match_one_by_one():
    prompts = [_prompt(n) for n in LENGTHS]
    engine = make_engine(max_num_batched_tokens=24)  # chunks straddle requests within one step
    got = engine.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert got == [greedy_reference(p, MAX_TOKENS) for p in prompts]
    engine.check_integrity()


@torch.inference_mode()
def test_chunked_prefill_logits_match_single_pass():
    """Logits, not just argmax: the same tokens fed in pieces give the same numbers."""
    prompt = _prompt(3 * BS + 5)
    table = [9, 2, 7, 4]
    whole = _feed(tiny_model(), KVCache.for_model(tiny_model().config, 10, BS), table, [prompt])
    pieces = _feed(tiny_model(), KVCache.for_model(tiny_model().config, 10, BS), table,
                   [prompt[:5], prompt[5:16], prompt[16:17], prompt[17:50], prompt[50:]])  # fmt: skip
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=0)
    ref = tiny_model().reference_logits(torch.tensor(prompt))
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=0)


def _feed(model, cache, table, chunks):
    out, done = [], 0
    for chunk in chunks:
        meta = AttentionMetadata.build([done], [len(chunk)], [table], BS)
        hidden = model(torch.tensor(chunk), torch.arange(done, done + len(chunk)), meta, cache)
        out.append(model.compute_logits(hidden))
        done += len(chunk)
    return torch.cat(out)


def test_attention_metadata_masks_causally_over_the_cached_prefix():
    meta = AttentionMetadata.build(starts=[0, 17], q_lens=[3, 1], block_tables=[[5], [1, 2, 3]], block_size=BS)
    assert meta.slot_blocks.tolist() == [5, 5, 5, 2] and meta.slot_offsets.tolist() == [0, 1, 2, 1]
    assert meta.block_tables.tolist() == [[5, 0], [1, 2]]  # only the blocks the context needs
    assert meta.mask.shape == (2, 1, 3, 2 * BS)
    assert meta.mask[0, 0, 1].nonzero().flatten().tolist() == [0, 1]
    assert meta.mask[1, 0, 0].nonzero().flatten().tolist() == list(range(18))
    with pytest.raises(ValueError, match="needs 2"):
        AttentionMetadata.build([10], [10], [[1]], BS)


def test_block_view_is_one_contiguous_block_of_the_cache():
    cfg = tiny_model().config
    cache = KVCache.for_model(cfg, 6, BS)
    assert cache.block_shape == (cfg.num_layers, 2, BS, cfg.num_kv_heads, cfg.head_dim)
    assert cache.block_nbytes == cfg.num_layers * 2 * BS * cfg.num_kv_heads * cfg.head_dim * 4
    assert cache.block_nbytes == cfg.kv_bytes_per_token * BS
    view = cache.block_view(3)
    assert view.is_contiguous() and view.data_ptr() == cache.tensor.data_ptr() + 3 * cache.block_nbytes
    view.fill_(1.5)  # writes land in the cache, in that block only
    assert cache.tensor[3].eq(1.5).all() and cache.tensor[2].eq(0).all() and cache.tensor[4].eq(0).all()
    layer = cache.layer(2)  # the model's per-layer view aliases the same memory
    assert layer[3, 1].eq(1.5).all()
    with pytest.raises(InvalidRequest, match="outside"):
        cache.block_view(6)


def test_gather_scatter_round_trip():
    cache = KVCache.for_model(tiny_model().config, 8, BS)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(0)))
    staged = cache.gather([5, 1, 6])
    assert staged.shape == (3, *cache.block_shape) and staged.is_contiguous()
    assert torch.equal(staged[0], cache.block_view(5))
    other = KVCache.for_model(tiny_model().config, 8, BS)
    other.scatter([0, 2, 4], staged)
    assert torch.equal(other.block_view(2), cache.block_view(1))
    assert other.tensor[[1, 3, 5, 6, 7]].eq(0).all()
    with pytest.raises(InvalidRequest, match="shape"):
        other.scatter([0, 1], staged)
    with pytest.raises(InvalidRequest, match="dtype"):
        other.scatter([0, 1, 2], staged.bfloat16())
    with pytest.raises(InvalidRequest, match="block ids"):
        cache.gather([8])
