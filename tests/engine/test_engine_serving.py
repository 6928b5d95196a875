"""The engine served for real: a store process, prefill and decode worker processes, the router's
HTTP API driven with the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from engine.router import RouterConfig  # noqa: E402
from engine.serve import Deployment, DeploymentSpec  # noqa: E402
from engine.worker import build_model  # noqa: E402

BS = 16


class Running:
    """A deployment on a background event loop, usable from synchronous tests."""

    def __init__(self, spec: DeploymentSpec) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.d = Deployment(spec)
        self.call(self.d.start())
        self.client = openai.OpenAI(base_url=self.d.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def call(self, coro):  # noqa: ANN001, ANN201
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)

    def complete(self, prompt, max_tokens=8, **extra):  # noqa: ANN001, ANN201
        r = self.client.completions.create(
            model="kvstore-llama", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra or None
        )
        return r, r.model_extra["kvstore"]

    def close(self) -> None:
        self.call(self.d.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens computed in this process, without any store."""
    from engine.config import EngineConfig
    from engine.llm import LLMEngine

    torch.set_num_threads(1)
    eng = LLMEngine(build_model("tiny"), EngineConfig(num_blocks=256, enable_prefix_caching=False))
    return lambda ids, n: eng.generate([ids], max_tokens=n, ignore_eos=True)[0]


@pytest.fixture(scope="module")
def disagg():
    # No local prefix caches: every reuse has to come through the store. Loads always: with the
    # tiny model, recomputing a few blocks can be estimated cheaper than loading them on a busy
    # machine, and these tests are about the store path (the cost model has its own tests).
    spec = DeploymentSpec(model="tiny", prefill=2, decode=2, store="embedded", prefix_cache=False,
                          load_policy="always", router=RouterConfig(routing="round_robin"))  # fmt: skip
    r = Running(spec)
    yield r
    r.close()


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("n", [1, BS - 1, BS, BS + 1, 5 * BS + 3])
def test_greedy_tokens_through_the_store_equal_no_store(disagg, reference, n):
    ids = prompt_ids(n, seed=n)
    _, info = disagg.complete(ids, max_tokens=12, ignore_eos=True)
    assert info["output_ids"] == reference(ids, 12)
    assert info["decode_worker"] != info["prefill_worker"]
    # The decode worker pulled every full block of the prompt from the store.
    assert info["decode_tokens_loaded"] == (n + 1) // BS * BS - (BS if (n + 1) % BS == 0 else 0) or n < BS


def test_prompt_that_fully_hits_the_store(disagg, reference):
    ids = prompt_ids(4 * BS, seed=99)
    _, first = disagg.complete(ids, max_tokens=6, ignore_eos=True)
    _, again = disagg.complete(ids, max_tokens=6, ignore_eos=True)  # round robin: the other prefill worker
    assert again["prefill_worker"] != first["prefill_worker"]
    # All full blocks but the last (whose last token must be computed to get logits) came from the store.
    assert again["tokens_loaded"] == 3 * BS and again["tokens_computed"] == BS
    # The worker reports its own TTFT and the load inside it; the router's TTFT includes both.
    assert 0 < again["load_ms"] <= again["worker_ttft_ms"] <= again["ttft_ms"]
    assert first["tokens_loaded"] == 0 and first["load_ms"] >= 0  # a load that found nothing: a miss
    assert again["output_ids"] == first["output_ids"] == reference(ids, 6)


def test_openai_client_streaming_and_not_with_a_repeated_prefix(disagg, reference):
    system = prompt_ids(6 * BS, seed=7)
    a = system + prompt_ids(9, seed=8)
    b = system + prompt_ids(5, seed=9)
    r1, i1 = disagg.complete(a, max_tokens=10, ignore_eos=True)
    assert r1.choices[0].finish_reason == "length" and r1.usage.completion_tokens == 10
    stream = disagg.client.completions.create(
        model="kvstore-llama", prompt=b, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    last = chunks[-1].model_extra["kvstore"]
    assert last["output_ids"] == reference(b, 10)
    assert last["tokens_loaded"] == 6 * BS  # the shared prefix came from the store
    assert text == disagg.call(_decode(disagg, last["output_ids"]))
    assert chunks[-1].choices[0].finish_reason == "length"
    models = disagg.client.models.list()
    assert [m.id for m in models.data] == ["kvstore-llama"]


async def _decode(r: Running, ids: list[int]) -> str:
    return r.d.router.tokenizer.decode(ids)


@pytest.mark.parametrize(
    "body,message",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": []}, "prompt is empty"),
        ({"prompt": [1] * 5000}, "exceeds the context limit"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"prompt": "hi", "temperature": -1}, "temperature must be a number"),
        ({"prompt": [999999]}, "outside the vocabulary"),
        ({"prompt": {"x": 1}}, "prompt must be a string"),
        ({"prompt": "hi", "n": 3}, "only n=1"),
    ],
)
def test_bad_requests_get_400_with_a_message(disagg, body, message):
    with pytest.raises(openai.BadRequestError) as ei:
        disagg.client.completions.create(model="kvstore-llama", **body)
    assert message in str(ei.value)


def test_health_and_metrics(disagg):
    import urllib.request

    h = json.loads(urllib.request.urlopen(disagg.d.url + "/health").read())
    assert h["ok"] and h["mode"] == "disagg" and len(h["workers"]) == 4
    from prometheus_client.parser import text_string_to_metric_families

    m = urllib.request.urlopen(disagg.d.url + "/metrics").read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(m) for s in f.samples
    }
    assert samples[("kvstore_engine_requests_total", (("status", "200"),))] >= 1
    assert samples[("kvstore_engine_ttft_seconds_count", ())] >= 1
    assert samples[("kvstore_engine_tokens_total", (("kind", "prompt"),))] > 0
    alive = sum(v for (n, lbl), v in samples.items() if n == "kvstore_engine_workers" and ("state", "alive") in lbl)
    assert alive == 4


def test_request_over_the_ttft_target_is_refused_early(disagg):
    router = disagg.d.router
    before = router.cfg.routing, router.cfg.ttft_target_s
    router.cfg.routing, router.cfg.ttft_target_s = "cache_aware", 1e-6
    try:
        with pytest.raises(openai.RateLimitError) as ei:
            disagg.complete(prompt_ids(40, seed=1))
        assert "exceeds the target" in str(ei.value)
    finally:
        router.cfg.routing, router.cfg.ttft_target_s = before


def test_store_corruption_and_store_down_are_answered_by_recompute(reference):
    r = Running(DeploymentSpec(model="tiny", prefill=1, decode=1, store="embedded", prefix_cache=False))
    try:
        ids = prompt_ids(8 * BS, seed=42)
        _, first = r.complete(ids, max_tokens=8, ignore_eos=True)
        # Corrupt every stored block in the store's shared memory (payload bytes, not headers).
        store = r.d.children[0]
        with open(store.info["shm_path"], "r+b") as f:
            raw = bytearray(f.read())
            i = raw.find(b"KVB1")
            while i != -1:
                raw[i + 64 + 100] ^= 0xFF
                i = raw.find(b"KVB1", i + 4)
            f.seek(0)
            f.write(raw)
        _, second = r.complete(ids, max_tokens=8, ignore_eos=True)
        assert second["output_ids"] == first["output_ids"] == reference(ids, 8)
        # Each damaged block is caught by its checksum: the load stops there (the prefill worker
        # then stores block 0 afresh, so the decode worker gets exactly that one back).
        assert second["tokens_loaded"] == 0 and second["decode_tokens_loaded"] <= BS
        # Now the store is gone altogether.
        store.kill()
        _, third = r.complete(ids + [5], max_tokens=8, ignore_eos=True)
        assert third["output_ids"] == reference(ids + [5], 8)
        assert third["tokens_loaded"] == 0
    finally:
        r.close()


def test_killed_decode_worker_fails_its_requests_clearly_and_new_ones_go_elsewhere(reference):
    r = Running(DeploymentSpec(model="tiny", prefill=1, decode=2, store="embedded"))
    try:
        router = r.d.router
        ids = prompt_ids(3 * BS, seed=5)
        stream = r.client.completions.create(
            model="kvstore-llama",
            prompt=ids,
            max_tokens=900,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        it = iter(stream)
        next(it)
        next(it)  # decode has started
        busy = [w for w in router.workers if w.role == "decode" and w.active]
        assert len(busy) == 1
        victim = next(c for c in r.d.children if c.info.get("url") == busy[0].url)
        victim.kill()
        with pytest.raises(openai.APIError) as ei:
            for _ in it:
                pass
        assert "decode worker" in str(ei.value) and "failed" in str(ei.value)
        # New requests are served by the other decode worker, correctly.
        for seed in (11, 12):
            q = prompt_ids(2 * BS + 3, seed=seed)
            _, info = r.complete(q, max_tokens=6, ignore_eos=True)
            assert info["decode_worker"] != busy[0].url
            assert info["output_ids"] == reference(q, 6)
    finally:
        r.close()


def test_colocated_mode_matches_too(reference):
    r = Running(DeploymentSpec(model="tiny", colocated=1, store="embedded"))
    try:
        ids = prompt_ids(2 * BS + 7, seed=3)
        _, info = r.complete(ids, max_tokens=8, ignore_eos=True)
        assert "decode_worker" not in info and info["output_ids"] == reference(ids, 8)
    finally:
        r.close()


def test_engine_demo_prints_ttft_with_and_without_reuse():
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "demo", "--sessions", "2", "--turns", "2"],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "greedy output identical with and without the store: yes" in r.stdout
    assert "TTFT p50:" in r.stdout and "with kvstore vs" in r.stdout


def test_device_tier_follows_the_workers_caches_and_a_killed_worker_leaves_it(reference):
    """Colocated workers report their caches to the store's index: a prefix one worker computed
    shows as its device-tier hit; the router sends the same prefix back to it; blocks its cache
    evicts leave the index; a SIGKILLed worker's holdings lapse within its time to live."""
    import time

    from kvstore import SyncKVStoreClient

    r = Running(DeploymentSpec(model="tiny", colocated=2, store="embedded", num_blocks=24))
    try:
        router = r.d.router
        ks = router.keyspace
        ids = prompt_ids(8 * BS + 5, seed=21)
        keys = ks.block_keys(ids)
        _, info = r.complete(ids, max_tokens=4, ignore_eos=True)
        assert info["output_ids"] == reference(ids, 4)
        with SyncKVStoreClient(r.d.store_addr) as c:

            def device(url: str) -> int:
                return c.lookup_tiers(keys).device(url)

            def wait(cond, what: str) -> None:  # noqa: ANN001
                deadline = time.monotonic() + 10
                while not cond():
                    assert time.monotonic() < deadline, what
                    time.sleep(0.1)

            urls = [w.url for w in router.workers]
            wait(lambda: max(device(u) for u in urls) == len(keys), "the computing worker's blocks never appeared")
            holder = next(u for u in urls if device(u) == len(keys))
            other = next(u for u in urls if u != holder)
            assert device(other) == 0
            # The same prefix again: the router sends it where it is held; the output is the same.
            _, again = r.complete(ids + [7, 8, 9], max_tokens=4, ignore_eos=True)
            assert again["tokens_cached"] >= 8 * BS
            assert again["output_ids"] == reference(ids + [7, 8, 9], 4)
            # Fill the holder's 24-block cache with other prompts (sent to it directly): its
            # cache evicts the first prefix, and the index hears of it.
            for seed in range(30, 34):
                q = prompt_ids(8 * BS, seed=seed)
                asyncio.run_coroutine_threadsafe(_complete_on(router.session, holder, q), r.loop).result(120)
            wait(lambda: device(holder) < len(keys), "blocks the cache evicted stayed in the index")
            # SIGKILL: no goodbye; the router sees it down and its holdings leave the index at
            # once (before its reports' 2 s time to live would have let them lapse).
            new_keys = ks.block_keys(prompt_ids(8 * BS, seed=33))
            wait(lambda: c.lookup_tiers(new_keys).device(holder) > 0, "the latest prompt was never reported")
            victim = next(ch for ch in r.d.children if ch.info.get("url") == holder)
            victim.kill()
            t = time.monotonic()
            wait(lambda: holder not in c.lookup_tiers(new_keys).engines, "a killed worker kept its holdings")
            assert time.monotonic() - t < 1.9
    finally:
        r.close()


async def _complete_on(session, url: str, ids: list[int]) -> None:  # noqa: ANN001
    body = {"prompt_ids": ids, "max_tokens": 1, "ignore_eos": True}
    async with session.post(url + "/generate", json=body) as resp:
        async for _ in resp.content:
            pass


def test_a_worker_pulls_a_prefix_another_holds_on_device_and_the_tokens_are_the_same(reference):
    """The prefix is only in worker A's cache (removed from the store); A is busy, so the
    router has A export it to the store and B load it: B computes only the tail, and the greedy
    tokens equal a store-less run."""
    import time

    from kvstore import SyncKVStoreClient

    r = Running(DeploymentSpec(model="tiny", colocated=2, store="embedded"))
    try:
        router = r.d.router
        ids = prompt_ids(8 * BS + 3, seed=41)
        keys = router.keyspace.block_keys(ids)
        _, first = r.complete(ids, max_tokens=2, ignore_eos=True)
        holder = next(w for w in router.workers if w.url == first["prefill_worker"])
        other = next(w for w in router.workers if w is not holder)
        with SyncKVStoreClient(r.d.store_addr) as c:
            deadline = time.monotonic() + 10
            while c.lookup_tiers(keys).device(holder.url) < len(keys):
                assert time.monotonic() < deadline, "the holder's blocks never reached the index"
                time.sleep(0.1)
            c.remove(keys)
            assert c.lookup(keys) == 0
        while not holder.reports_device_tier:  # the router's view of its health: reports taken
            assert time.monotonic() < deadline, "the router never saw the holder's reports taken"
            time.sleep(0.1)
        holder.queued_tokens += 10**7  # busy: the router will not queue more on it
        try:
            q = ids + [1, 2, 3]
            _, info = r.complete(q, max_tokens=6, ignore_eos=True)
        finally:
            holder.queued_tokens -= 10**7
        assert info["prefill_worker"] == other.url and info["pulled_from"] == holder.url
        assert info["pulled_blocks"] == len(keys)
        assert info["tokens_loaded"] == len(keys) * BS and info["tokens_computed"] == len(q) - len(keys) * BS
        assert info["output_ids"] == reference(q, 6)
    finally:
        r.close()
