"""The router's choices, on workers described by their health (no processes needed)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("aiohttp")

from engine.router import RequestError, Router, RouterConfig, WorkerRef  # noqa: E402
from kvstore.keys import KeySpace, ModelFingerprint  # noqa: E402

KS = KeySpace(ModelFingerprint("router-test", "float32", 2, 2, 64))


def make(routing: str = "cache_aware", target: float = 10.0, n: int = 2) -> Router:
    health = {"prefill_tps": 1000.0, "store_effective_bandwidth": 1e9, "max_num_seqs": 8, "step_s": 0.02}
    workers = [WorkerRef(f"http://p{i}", "prefill", health=dict(health)) for i in range(n)]
    workers += [WorkerRef(f"http://d{i}", "decode", health=dict(health)) for i in range(2)]
    r = Router(RouterConfig(routing=routing, ttft_target_s=target), workers)
    r.info = {"block_size": 16, "block_bytes": 1 << 20}
    r.keyspace = KS
    return r


def choose(r: Router, keys, n_tokens):  # noqa: ANN001, ANN201
    return asyncio.run(r.choose_prefill(keys, n_tokens))


def test_prefers_the_worker_that_holds_the_prefix_locally():
    r = make()
    keys = KS.block_keys(list(range(800)))
    r.workers[1].remember(keys[:40], 1000)
    w, est, cost = choose(r, keys, 800)
    assert w is r.workers[1] and cost == 800 - 40 * 16
    assert est == pytest.approx(cost / 1000.0)


def test_spreads_load_when_the_holder_is_busy():
    r = make()
    keys = KS.block_keys(list(range(800)))
    r.workers[1].remember(keys, 1000)
    r.workers[1].queued_tokens = 5000  # five seconds of work queued
    w, _, cost = choose(r, keys, 800)
    assert w is r.workers[0] and cost == 800


def test_refuses_what_cannot_meet_the_ttft_target():
    r = make(target=0.5)
    with pytest.raises(RequestError) as ei:
        choose(r, KS.block_keys(list(range(800))), 800)
    assert ei.value.status == 429 and "exceeds the target" in ei.value.message


def test_round_robin_ignores_estimates():
    r = make(routing="round_robin")
    keys = KS.block_keys(list(range(64)))
    picks = [choose(r, keys, 64)[0].url for _ in range(4)]
    assert picks == ["http://p0", "http://p1", "http://p0", "http://p1"]


def test_decode_choice_by_load_and_dead_workers_are_skipped():
    r = make()
    r.workers[2].active = 5
    assert r.choose_decode() is r.workers[3]
    r.workers[3].alive = False
    assert r.choose_decode() is r.workers[2]
    r.workers[2].alive = False
    with pytest.raises(RequestError) as ei:
        r.choose_decode()
    assert ei.value.status == 503


def test_ties_go_to_the_worker_with_fewer_requests_in_flight():
    r = make()
    keys = KS.block_keys(list(range(64)))
    r.workers[0].active = 3
    assert choose(r, keys, 64)[0] is r.workers[1]


class FakeStore:
    """The store's per-tier lookup, as kvstore's client answers it (kvstore.client.engines)."""

    def __init__(self, keys, stored: int, devices: dict[str, int]) -> None:  # noqa: ANN001
        from kvstore.client.engines import EngineHolding, TierLookup

        n = len(keys)
        self.answer = TierLookup(
            n,
            bytes([1] * stored + [0] * (n - stored)),
            {url: EngineHolding(url, bytes([1] * d + [0] * (n - d))) for url, d in devices.items()},
        )

    async def lookup_tiers(self, keys):  # noqa: ANN001, ANN201
        return self.answer


def reporting(r: Router) -> Router:
    for w in r.workers:
        w.health["device_tier"] = {"engine_id": w.url, "blocks": 0, "reports": 1, "failures": 0}
    return r


def test_the_device_tier_decides_where_a_prefix_is_held():
    r = reporting(make())
    keys = KS.block_keys(list(range(800)))
    # The router once sent the prefix to p0, but p0's cache dropped it; p1 holds 30 blocks on device.
    r.workers[0].recent.update({k: 0.0 for k in keys})
    r.store = FakeStore(keys, stored=0, devices={"http://p1": 30})
    w, _est, cost = choose(r, keys, 800)
    assert w is r.workers[1] and cost == 800 - 30 * 16


def test_a_device_hit_needs_no_load_and_a_store_hit_costs_its_transfer():
    r = reporting(make())
    keys = KS.block_keys(list(range(800)))
    r.store = FakeStore(keys, stored=40, devices={"http://p0": 40})
    tiers = asyncio.run(r._tiers(keys))
    assert r.uncached_tokens(r.workers[0], keys, 800, tiers) == (800 - 40 * 16, 0)
    assert r.uncached_tokens(r.workers[1], keys, 800, tiers) == (800 - 40 * 16, 40 * (1 << 20))
    assert choose(r, keys, 800)[0] is r.workers[0]


def test_a_worker_that_does_not_report_is_judged_by_what_the_router_sent_it():
    r = make()  # no device_tier in health
    keys = KS.block_keys(list(range(800)))
    r.store = FakeStore(keys, stored=0, devices={"http://p1": 50})
    r.workers[0].remember(keys[:10], 1000)
    w, _, cost = choose(r, keys, 800)
    assert w is r.workers[0] and cost == 800 - 10 * 16


def test_least_loaded_ignores_caches():
    r = reporting(make(routing="least_loaded"))
    keys = KS.block_keys(list(range(800)))
    r.store = FakeStore(keys, stored=0, devices={"http://p1": 50})
    r.workers[1].queued_tokens = 100
    assert choose(r, keys, 800)[0] is r.workers[0]


def test_a_prefix_on_a_busy_peers_device_is_pulled_through_the_store():
    r = reporting(make())
    keys = KS.block_keys(list(range(800)))
    r.store = FakeStore(keys, stored=0, devices={"http://p1": 40})
    r.workers[1].queued_tokens = 5000  # p1 holds the prefix but has five seconds of work queued
    c = asyncio.run(r.plan_prefill(keys, 800))
    assert c.worker is r.workers[0] and c.pull_from is r.workers[1] and c.pull_blocks == 40
    assert c.cost == 800 - 40 * 16
    # Idle, the holder computes it itself; and without cache awareness nothing is pulled.
    r.workers[1].queued_tokens = 0
    c = asyncio.run(r.plan_prefill(keys, 800))
    assert c.worker is r.workers[1] and c.pull_from is None
    rr = reporting(make(routing="round_robin"))
    rr.store = FakeStore(keys, stored=0, devices={"http://p1": 40})
    assert all(asyncio.run(rr.plan_prefill(keys, 800)).pull_from is None for _ in range(2))


def test_what_the_router_just_sent_counts_until_the_report_lands():
    r = reporting(make())
    keys = KS.block_keys(list(range(800)))
    r.store = FakeStore(keys, stored=0, devices={})  # p1's report of these has not landed yet
    r.workers[1].remember(keys[:20], 1000)
    w, _, cost = choose(r, keys, 800)
    assert w is r.workers[1] and cost == 800 - 20 * 16
    r.workers[1].health["device_tier"]["synced"] = False  # its reports fail: what was sent counts
    assert choose(r, keys, 800)[0] is r.workers[1]
