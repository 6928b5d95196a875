"""The vLLM connector's planning and block copies, without vLLM: what is looked up, loaded and
saved for what vLLM scheduled, and how paged caches become stored blocks and back."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.integrations.vllm.blocks import PagedBlocks
from kvstore.integrations.vllm.plan import Planner, split_keys
from kvstore.keys import KEY_BYTES, KeySpace, ModelFingerprint

BS = 4
KS = KeySpace(ModelFingerprint("m", "float32", 2, 2, 8, block_size=BS, layout="vllm:cpu"))


class FakeStore:
    """Holds keys; lookup answers the leading run, like the service."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.calls = 0
        self.down = False

    def lookup(self, packed: bytes) -> int:
        self.calls += 1
        if self.down:
            raise Unavailable("metadata service unreachable")
        n = 0
        for k in split_keys(packed):
            if k not in self.keys:
                break
            n += 1
        return n


def request(rid: str, prompt: list[int], **kw) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid, prompt_token_ids=prompt, all_token_ids=list(prompt), lora_request=None, mm_features=[], **kw
    )


def new_step(rid: str, block_ids: list[int], computed: int, scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(block_ids,), num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={rid: scheduled},
    )


def cached_step(rid: str, new_ids: list[int] | None, computed: int, scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid],
            resumed_req_ids=set(),
            new_block_ids=[(new_ids,) if new_ids is not None else None],
            num_computed_tokens=[computed],
        ),
        num_scheduled_tokens={rid: scheduled},
    )


def planner(store: FakeStore, **kw) -> Planner:
    return Planner(KS, store.lookup, block_bytes=1024, **kw)


def test_the_hit_leaves_the_last_prompt_token_to_compute_and_the_load_names_its_blocks():
    store = FakeStore()
    prompt = list(range(12))  # exactly 3 blocks
    store.keys.update(KS.block_keys(prompt))
    p = planner(store)
    r = request("a", prompt)
    # 3 blocks stored, but the last one holds the prompt's last token: 2 blocks can be loaded.
    assert p.matched(r, 0) == 8 and store.calls == 1
    p.allocated(r, 8)
    loads, saves = p.step(new_step("a", [7, 3, 9], computed=8, scheduled=4))
    assert [(t.req_id, t.block_ids, t.keys) for t in loads] == [("a", [7, 3], b"".join(KS.block_keys(prompt)[:2]))]
    assert saves == []  # all three blocks are stored already


def test_local_hits_count_and_misses_are_not_errors():
    store = FakeStore()
    prompt = list(range(10))
    store.keys.update(KS.block_keys(prompt)[:1])
    p = planner(store)
    assert p.matched(request("a", prompt), 4) == 0  # vLLM holds block 0 itself
    assert p.matched(request("b", [1, 2, 3]), 0) == 0  # no full block: no lookup at all
    assert store.calls == 1
    store.down = True
    assert p.matched(request("c", prompt), 0) == 0
    assert p.stats.lookup_failures == 1


def test_a_store_that_fails_is_not_asked_again_until_its_backoff_has_passed():
    store = FakeStore()
    prompt = list(range(8))
    store.keys.update(KS.block_keys(prompt))
    now = [100.0]
    p = Planner(KS, store.lookup, block_bytes=1024, clock=lambda: now[0])
    store.down = True
    assert p.matched(request("a", prompt), 0) == 0 and store.calls == 1
    assert p.matched(request("b", prompt), 0) == 0 and store.calls == 1  # within 1 s: not asked
    now[0] += 1.1
    assert p.matched(request("c", prompt), 0) == 0 and store.calls == 2  # failed again: 2 s now
    now[0] += 1.5
    assert p.matched(request("d", prompt), 0) == 0 and store.calls == 2
    store.down = False
    now[0] += 1.0
    assert p.matched(request("e", prompt), 0) == 4 and store.calls == 3  # back: answers as before
    assert p.matched(request("f", prompt), 0) == 4 and store.calls == 4
    assert p.stats.lookups_skipped == 2


def test_saves_follow_the_blocks_each_step_completes_decode_included():
    store = FakeStore()
    prompt = list(range(10))
    p = planner(store)
    r = request("a", prompt)
    assert p.matched(r, 0) == 0
    _, saves = p.step(new_step("a", [5, 6, 8], computed=0, scheduled=10))
    keys = KS.block_keys(prompt)
    assert [(t.block_ids, t.keys) for t in saves] == [([5, 6], b"".join(keys))]
    # Decoding: token 10 is sampled, then token 11; block 2 completes when token 11's KV is computed.
    r.all_token_ids.extend([40, 41])
    assert p.step(cached_step("a", None, computed=10, scheduled=1))[1] == []
    r.all_token_ids.append(42)
    _, saves = p.step(cached_step("a", None, computed=11, scheduled=1))
    full = KS.block_keys(prompt + [40, 41])
    assert [(t.block_ids, t.keys) for t in saves] == [([8], full[2])]
    # A draft token scheduled beyond the known ones is never counted.
    _, saves = p.step(cached_step("a", [2], computed=12, scheduled=5))
    assert saves == []


def test_a_consumer_saves_nothing_and_policy_never_loads_nothing():
    store = FakeStore()
    prompt = list(range(9))
    store.keys.update(KS.block_keys(prompt))
    consumer = planner(store, save=False)
    r = request("a", prompt)
    assert consumer.matched(r, 0) == 8
    consumer.allocated(r, 8)
    loads, saves = consumer.step(new_step("a", [1, 2, 3], computed=8, scheduled=1))
    assert len(loads) == 1 and saves == []
    assert planner(store, policy="never").matched(request("b", prompt), 0) == 0
    with pytest.raises(ValueError):
        planner(store, policy="sometimes")


def test_recompute_judged_cheaper_skips_the_load():
    store = FakeStore()
    prompt = list(range(9))
    store.keys.update(KS.block_keys(prompt))
    p = planner(store)
    p.cost.observe_load(1 << 20, 1.0)  # 1 MiB/s: loading 2 KiB takes ~2 ms
    p.cost.observe_compute(1_000_000, 1.0)  # 8 tokens in 8 us
    assert p.matched(request("a", prompt), 0) == 0 and p.stats.loads_skipped == 1


def test_salt_lora_and_multimodal_inputs_change_every_key():
    store = FakeStore()
    prompt = list(range(8))
    store.keys.update(KS.block_keys(prompt))
    p = planner(store)
    assert p.matched(request("a", prompt), 0) == 4
    assert p.matched(request("b", prompt, cache_salt="tenant-b"), 0) == 0
    lora = request("c", prompt)
    lora.lora_request = SimpleNamespace(lora_name="x", lora_int_id=1)
    assert p.matched(lora, 0) == 0
    mm = request("d", prompt)
    mm.mm_features = [SimpleNamespace(identifier="img-hash", mm_position=SimpleNamespace(offset=2))]
    assert p.matched(mm, 0) == 0
    assert {len(k) for k in p.requests["b"].keys} == {KEY_BYTES}


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first"])
def test_paged_blocks_round_trip_and_byte_order(layout):
    nb = 6
    if layout == "blocks_first":  # vLLM's CPU backend: [num_blocks, kv_heads, block_size, 2 * head_dim]
        caches = {f"l{i}": torch.randn(nb, 2, BS, 16) for i in range(2)}
    else:  # FlashAttention: [2, num_blocks, block_size, kv_heads, head_dim]
        caches = {f"l{i}": torch.randn(2, nb, BS, 2, 8) for i in range(2)}
    pb = PagedBlocks(caches, nb)
    assert pb.block_bytes == 2 * 2 * BS * 16 * 4
    rows = pb.gather([4, 1])
    first = caches["l0"][4] if layout == "blocks_first" else caches["l0"][:, 4]
    assert rows[0, : first.numel() * 4].tobytes() == first.contiguous().numpy().tobytes()
    fresh = {k: torch.zeros_like(v) for k, v in caches.items()}
    out = PagedBlocks(fresh, nb)
    for layer in range(2):
        out.scatter(layer, rows, [2, 5])
    for k in caches:
        if layout == "blocks_first":
            assert torch.equal(fresh[k][2], caches[k][4]) and torch.equal(fresh[k][5], caches[k][1])
            assert torch.count_nonzero(fresh[k][0]) == 0
        else:
            assert torch.equal(fresh[k][:, 2], caches[k][:, 4]) and torch.equal(fresh[k][:, 5], caches[k][:, 1])
    # Only as many rows as block ids are written: a short load fills a prefix of them.
    out.scatter(0, rows[:1], [0])
    assert np.array_equal(out.gather([0])[0, : pb.layers[0].nbytes], rows[0, : pb.layers[0].nbytes])


def test_paged_blocks_refuse_what_they_cannot_address():
    with pytest.raises(InvalidArgument, match="no dimension of 6 blocks"):
        PagedBlocks({"l0": torch.zeros(3, 4, 5)}, 6)
    pb = PagedBlocks({"l0": torch.zeros(6, 2, BS, 8)}, 6)
    with pytest.raises(InvalidArgument, match="block ids"):
        pb.gather([6])
    with pytest.raises(InvalidArgument):
        PagedBlocks({}, 6)


def test_a_failed_load_drops_its_steps_saves_and_they_are_planned_again():
    store = FakeStore()
    prompt = list(range(21))  # 5 full blocks
    store.keys.update(KS.block_keys(prompt)[:3])
    p = planner(store)
    r = request("a", prompt)
    assert p.matched(r, 0) == 12
    p.allocated(r, 12)
    loads, saves = p.step(new_step("a", [10, 11, 12, 13, 14, 15], computed=12, scheduled=9))
    assert [t.first for t in loads] == [0] and [(t.first, t.block_ids) for t in saves] == [(3, [13, 14])]
    # The worker got only block 0 of the load and dropped the saves: the store holds 1 block, and
    # blocks from 1 on are saved again once vLLM has recomputed them.
    p.failed([("a", 1)], [("a", 3)])
    assert p.requests["a"].stored == 1 and p.requests["a"].saved == 1
    _, saves = p.step(cached_step("a", None, computed=21, scheduled=1))
    assert [(t.first, t.block_ids) for t in saves] == [(1, [11, 12, 13, 14])]


def test_prompt_embeddings_and_inputs_that_change_turn_the_request_off():
    store = FakeStore()
    prompt = list(range(8))
    store.keys.update(KS.block_keys(prompt))
    p = planner(store)
    assert p.matched(request("e", prompt, prompt_embeds=object()), 0) == 0
    assert p.step(new_step("e", [1, 2], computed=0, scheduled=8)) == ([], [])
    r = request("s", prompt)
    assert p.matched(r, 0) == 4
    r.mm_features = [SimpleNamespace(identifier="late-image", mm_position=SimpleNamespace(offset=6))]
    assert p.step(new_step("s", [1, 2], computed=0, scheduled=8)) == ([], [])


def test_each_parallel_rank_has_its_own_keys():
    keys = b"".join(KS.block_keys(list(range(8))))
    assert split_keys(keys) == [keys[:16], keys[16:]]
    r0, r1 = split_keys(keys, "tp0/2|pp0/1"), split_keys(keys, "tp1/2|pp0/1")
    assert len({*r0, *r1, keys[:16], keys[16:]}) == 6 and all(len(k) == 16 for k in r0 + r1)
    assert split_keys(keys, "tp1/2|pp0/1") == r1  # the same for every process
