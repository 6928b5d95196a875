"""The load and save hooks, driven by an in-memory stand-in for the store: greedy output with KV
pulled from elsewhere equals output computed from scratch, and a failed load is a shorter hit."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from engine_testlib import greedy_reference, make_engine, single_threaded_torch  # noqa: E402, F401

from engine.hooks import LoadRequest, SavedBlocks  # noqa: E402

BS = 16
PROMPT = [(3 * i + 1) % 256 for i in range(3 * BS + 4)]  # three full blocks + 4 tokens


class DictStore:
    """Keeps copies of saved blocks by key; loads the longest leading run it has."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, torch.Tensor] = {}
        self.saved: list[SavedBlocks] = []
        self.loads: list[LoadRequest] = []

    def saver(self, engine):
        def save(saved: SavedBlocks) -> None:
            self.saved.append(saved)
            for key, block in zip(saved.keys, engine.kv_cache.gather(saved.block_ids)):
                self.blocks[key] = block  # gather made a copy: safe after the call

        return save

    def loader(self, engine, limit: int | None = None):
        def load(req: LoadRequest) -> int:
            self.loads.append(req)
            n = req.num_cached_tokens // BS
            while (n + 1) * BS <= req.max_tokens and req.keys[n] in self.blocks and (limit is None or n < limit):
                engine.kv_cache.block_view(req.block_ids[n]).copy_(self.blocks[req.keys[n]])
                n += 1
            return n * BS

        return load


def test_kv_from_the_store_gives_the_same_tokens():
    store = DictStore()
    writer = make_engine()
    writer.save_hook = store.saver(writer)
    expected = writer.generate([PROMPT], max_tokens=10, ignore_eos=True)
    assert expected == [greedy_reference(PROMPT, 10)]
    (saved,) = store.saved
    assert saved.phase == "prefill" and saved.first_block == 0
    assert list(saved.keys) == writer.keyspace.block_keys(PROMPT)  # the store's own key function
    reader = make_engine()
    assert reader.keyspace.root == writer.keyspace.root  # same weights, same keys
    reader.generate([[250] * 40], max_tokens=2)  # so the reader's block ids differ from the writer's
    reader.load_hook = store.loader(reader)
    assert reader.generate([PROMPT], max_tokens=10, ignore_eos=True) == expected
    assert reader.stats.loaded_tokens == 3 * BS
    assert reader.stats.prefill_tokens == 40 + len(PROMPT) - 3 * BS  # only the rest was computed
    # loaded blocks join the local prefix cache: a second request hits them locally
    reader.generate([PROMPT[:-1] + [9]], max_tokens=3, ignore_eos=True)
    assert reader.stats.cached_tokens == 3 * BS and store.loads[-1].num_cached_tokens == 3 * BS
    reader.check_integrity()
    # and the comparison can fail: a store that hands back wrong KV changes the tokens
    liar = make_engine()
    liar.load_hook = lambda req: (liar.kv_cache.block_view(req.block_ids[0]).normal_(), BS)[1]
    assert liar.generate([PROMPT], max_tokens=10, ignore_eos=True) != expected


def test_partial_and_failed_loads_are_shorter_hits(caplog):
    store = DictStore()
    writer = make_engine()
    writer.save_hook = store.saver(writer)
    expected = writer.generate([PROMPT], max_tokens=8, ignore_eos=True)

    partial = make_engine()
    partial.load_hook = store.loader(partial, limit=1)
    assert partial.generate([PROMPT], max_tokens=8, ignore_eos=True) == expected
    assert partial.stats.loaded_tokens == BS

    def broken(req: LoadRequest) -> int:
        raise ConnectionError("store unreachable")

    failing = make_engine()
    failing.load_hook = broken
    with caplog.at_level(logging.WARNING, logger="engine.scheduler"):
        assert failing.generate([PROMPT], max_tokens=8, ignore_eos=True) == expected
    assert failing.stats.loaded_tokens == 0
    assert "load_hook_failed" in caplog.text and "store unreachable" in caplog.text
    failing.check_integrity()


def test_a_load_hook_that_breaks_its_contract_is_refused_without_leaking():
    engine = make_engine()
    engine.load_hook = lambda req: req.max_tokens + BS  # claims more than it may
    rid = engine.add_request(PROMPT, max_tokens=4)
    with pytest.raises(ValueError, match="load hook returned 64 .* multiple of 16 in \\[0, 48\\]"):
        engine.step()
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.config.num_blocks
    assert engine.abort(rid) and not engine.has_unfinished()


def test_decode_blocks_are_saved_when_asked():
    store = DictStore()
    engine = make_engine(save_decode_blocks=True)
    engine.save_hook = store.saver(engine)
    (out,) = engine.generate([PROMPT], max_tokens=30, ignore_eos=True)  # 52 + 29 tokens get KV: 5 blocks
    phases = [(s.phase, s.first_block, len(s.keys)) for s in store.saved]
    assert phases == [("prefill", 0, 3), ("decode", 3, 1), ("decode", 4, 1)]
    assert list(store.blocks) == engine.keyspace.block_keys(PROMPT + out)[:5]
    assert engine.stats.saved_blocks == 5


def test_save_hook_failure_does_not_stop_generation(caplog):
    engine = make_engine()

    def broken(saved: SavedBlocks) -> None:
        raise OSError("disk full")

    engine.save_hook = broken
    with caplog.at_level(logging.WARNING, logger="engine.scheduler"):
        assert engine.generate([PROMPT], max_tokens=5, ignore_eos=True) == [greedy_reference(PROMPT, 5)]
    assert "save_hook_failed" in caplog.text
    engine.check_integrity()
