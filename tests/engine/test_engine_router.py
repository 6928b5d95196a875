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
