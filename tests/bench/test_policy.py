"""The cache-policy benchmark and its workloads: well-formed, consistent numbers; the two
reference policies checked against hand-counted streams and an exhaustive search."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import policy  # noqa: E402
from bench.policy import (  # noqa: E402
    Stream,
    frequency_oracle_hits,
    kvstore_hits,
    lru_hits,
    make_index,
    next_uses,
    optimal_hits,
)
from bench.workloads import KEYSPACE, WORKLOADS, Trace, find_trace, make  # noqa: E402
from bench.workloads.trace import HASH_BLOCK_TOKENS, hash_block_tokens, load_trace  # noqa: E402

try:
    TRACE: Path | None = find_trace()
except FileNotFoundError:
    TRACE = None
needs_trace = pytest.mark.skipif(TRACE is None, reason="conversation trace not found (set KVSTORE_TRACE)")

# Small versions of the quick workloads: a few seconds for the whole suite.
SMALL = {
    "chat": {"scale": 0.25, "sessions": 40, "duration_s": 600.0},
    "docqa": {"scale": 0.25, "docs": 16, "duration_s": 600.0},
    "fewshot": {"scale": 0.25, "requests_n": 120},
    "trace": {"tokens_per_hash_block": 16, "max_requests": 600},
}
CAPS = (30, 100, 300, 1000, 3000)


def key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def stream_of(requests: Sequence[Sequence[int]]) -> Stream:
    return Stream.from_keys("hand", [[key(b) for b in r] for r in requests])


# ---- the suite as a whole --------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_result() -> dict:
    names = [n for n in SMALL if n != "trace" or TRACE is not None]
    return policy.run(quick=True, workloads=names, capacities=CAPS, jobs=1, overrides=SMALL, progress=False)


def test_numbers_are_well_formed(small_result: dict) -> None:
    assert small_result["capacities"] == list(CAPS)
    for name, w in small_result["workloads"].items():
        assert w["requests"] > 0 and w["block_refs"] >= w["distinct_blocks"] > 0, name
        assert 0.0 <= w["bound_hit_rate"] < 1.0
        assert [r["capacity"] for r in w["rows"]] == list(CAPS)
        for r in w["rows"]:
            for k in ("hit_rate", "lru_hit_rate", "optimal_hit_rate"):
                assert 0.0 <= r[k] <= 1.0, (name, r)
            # No policy beats the optimum, nor the compulsory-miss bound (exact equality allowed).
            assert r["hits"]["kvstore"] <= r["hits"]["optimal"], (name, r)
            assert r["hits"]["lru"] <= r["hits"]["optimal"], (name, r)
            assert r["hits"]["optimal"] <= w["block_refs"] - w["distinct_blocks"], (name, r)
            ratio = r["hits"]["kvstore"] / r["hits"]["optimal"] if r["hits"]["optimal"] else 1.0
            assert r["hit_over_optimal"] == pytest.approx(ratio, abs=1e-4)
            assert r["hit_rate"] == pytest.approx(r["hits"]["kvstore"] / w["block_refs"], abs=1e-4)
        for p in ("lru", "optimal"):  # both are stack policies: more room never loses a hit
            hits = [r["hits"][p] for r in w["rows"]]
            assert hits == sorted(hits), (name, p, hits)
        for r in w["rows"]:  # every baseline and kvstore's lru mode are online: none beats MIN
            for p, h in r["hits"].items():
                assert h <= r["hits"]["optimal"], (name, p, r)
            assert r["best_baseline"] in policy.BASELINE_NAMES
            want = r["hits"]["kvstore"] / r["hits"]["lru"] if r["hits"]["lru"] else 1.0
            assert r["hit_over_lru"] == pytest.approx(want, abs=1e-4)
    for m in small_result["missed"]:
        assert m["target"].startswith(("trace_hit_over_lru_", ">= best baseline", ">= LRU - ")), m
    for c in policy.TRACE_OVER_LRU_TARGETS:
        field = f"trace_hit_over_lru_{c // 1000}k"
        row = next((r for r in small_result["workloads"]["trace"]["rows"] if r["capacity"] == c), None)
        assert (field in small_result) == (row is not None)
        if row is not None:
            assert small_result[field] == row["hit_over_lru"]


def test_report_renders(small_result: dict, tmp_path: Path) -> None:
    r = {"command": "python bench/policy.py --quick", "date": "today", "machine": "here", **small_result}
    r["notes"] = policy.notes(r)
    text = policy.render(r, "policy_hit_rate.png")
    assert "| chat | 1,000 |" in text and "![policy hit rate](results/policy_hit_rate.png)" in text
    assert policy.plot(r, tmp_path / "p.png") in (True, False)


def test_index_run_keeps_its_accounting() -> None:
    w = make("docqa", quiet=True, **SMALL["docqa"])
    s = Stream.from_workload(w)
    idx = make_index(300)
    out = kvstore_hits(s, 300, index=idx)
    idx.check_integrity()
    assert out["inserted"] <= s.refs and idx.daemons["bench-daemon"].segments[1].blocks <= 300


# ---- the reference policies on hand-made streams ---------------------------------------------

# Capacity 3. Per request, the hits counted by hand (LRU order shown oldest -> newest after it):
#   [1,2,3] 0  -> 1 2 3
#   [1,2,4] 2  -> 1 2 4   (3 evicted)
#   [1,2,3] 2  -> 1 2 3   (4 evicted)
#   [5,6]   0  -> 3 5 6   (1, 2 evicted)
#   [1,2,3] 0  -> 1 2 3   (3 was present but 1 was not: no prefix hit)
#   [1,2,4] 2  -> 1 2 4
HAND = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5, 6], [1, 2, 3], [1, 2, 4]]
HAND_LRU_HITS = [0, 2, 2, 0, 0, 2]


def tiny_lru(requests: Sequence[Sequence[int]], capacity: int) -> list[int]:
    """A list-based LRU, written independently of bench.policy: per-request prefix hits."""
    order: list[int] = []  # oldest first
    out = []
    for r in requests:
        h = 0
        while h < len(r) and r[h] in order:
            h += 1
        out.append(h)
        for b in r:
            if b in order:
                order.remove(b)
            elif len(order) == capacity:
                order.pop(0)
            order.append(b)
    return out


def test_lru_matches_hand_count() -> None:
    assert tiny_lru(HAND, 3) == HAND_LRU_HITS
    for k in range(1, len(HAND) + 1):
        assert lru_hits(HAND[:k], 3)["hits"] == sum(HAND_LRU_HITS[:k])


def test_lru_matches_tiny_simulation_on_random_streams() -> None:
    rng = random.Random(7)
    for _ in range(50):
        reqs = random_chains(rng, n=20, depth=5, fanout=3)
        for cap in (1, 2, 5, 9):
            assert lru_hits(reqs, cap)["hits"] == sum(tiny_lru(reqs, cap))


def test_next_uses() -> None:
    flat = np.array([5, 7, 5, 9, 7, 5])
    assert next_uses(flat).tolist() == [2, 4, 5, 6, 6, 6]


def test_optimal_on_hand_stream() -> None:
    # Capacity 2, chains A=[1,2] and B=[3,4] alternating A B A B A. LRU thrashes (0 hits);
    # MIN keeps A, bypasses B (used later than A every time), and hits A twice: 4 blocks.
    reqs = [[1, 2], [3, 4], [1, 2], [3, 4], [1, 2]]
    s = stream_of(reqs)
    assert lru_hits(reqs, 2)["hits"] == 0
    out = optimal_hits(s.flat, s.offsets, 2)
    assert out["hits"] == 4 and out["block_hits"] == 4 and out["inserted"] == 2
    # HAND at capacity 3: MIN keeps 1, 2, 3 and bypasses 4, 5 and 6 (each used later than
    # everything kept, or never again): 0 + 2 + 3 + 0 + 3 + 2 = 10 blocks, 3 stored.
    s = stream_of(HAND)
    out = optimal_hits(s.flat, s.offsets, 3)
    assert out["hits"] == 10 and out["inserted"] == 3
    assert best_prefix_hits(HAND, 3) == 10


def test_frequency_oracle_on_hand_stream() -> None:
    # Uses: 1 x4, 2 x3, 3 x2, 7 x2, 4 x1. Capacity 2 keeps {1, 2}: hits on their later uses
    # where they lead the request: 1+2 (req 2), 1+2 (req 3), 1 (req 4) = 5.
    reqs = [[1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 7], [7]]
    s = stream_of(reqs)
    out = frequency_oracle_hits(s.flat, s.offsets, 2)
    assert out == {"hits": 5, "inserted": 2}
    # A tie between a block and its successor (3 and 7 both x2): the one used first ranks first,
    # so capacity 3 keeps 1, 2, 3 (prefix-closed) and adds the third block of request 2.
    assert frequency_oracle_hits(s.flat, s.offsets, 3)["hits"] == 6
    # Never above MIN, and more room never loses a hit.
    for cap in range(1, 7):
        assert frequency_oracle_hits(s.flat, s.offsets, cap)["hits"] <= optimal_hits(s.flat, s.offsets, cap)["hits"]
        assert (
            frequency_oracle_hits(s.flat, s.offsets, cap)["hits"]
            <= frequency_oracle_hits(s.flat, s.offsets, cap + 1)["hits"]
        )


def test_kvstore_keeps_a_chains_head_where_lru_keeps_its_tail() -> None:
    # Capacity 3: chain [1,2,3], a one-block request, the chain again. LRU evicts 1 (the head,
    # least recent) and gets 0; the index evicts 3 (the tail) and gets 2; MIN bypasses 5: 3.
    reqs = [[1, 2, 3], [5], [1, 2, 3]]
    s = stream_of(reqs)
    assert lru_hits(reqs, 3)["hits"] == 0
    assert kvstore_hits(s, 3)["hits"] == 2
    assert optimal_hits(s.flat, s.offsets, 3)["hits"] == 3


# ---- MIN is optimal: exhaustive search on tiny streams ---------------------------------------


def random_chains(rng: random.Random, n: int, depth: int, fanout: int) -> list[list[int]]:
    """``n`` requests, each a path from the root of a small trie: block ids stand for prefixes,
    as chained keys do."""
    ids: dict[tuple[int, ...], int] = {}
    out = []
    for _ in range(n):
        path: tuple[int, ...] = ()
        req = []
        for _ in range(rng.randint(1, depth)):
            path = (*path, rng.randrange(fanout))
            req.append(ids.setdefault(path, len(ids)))
        out.append(req)
    return out


def best_prefix_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """The most prefix hits any policy of ``capacity`` blocks can get: every choice (keep or not,
    and which block to evict) tried, memoised on (position, cache contents)."""
    flat = [(r, b) for r, req in enumerate(requests) for b in req]
    starts = {sum(len(x) for x in requests[:r]) for r in range(len(requests))}

    @cache
    def go(p: int, held: frozenset[int]) -> int:
        if p == len(flat):
            return 0
        r, _ = flat[p]
        gain = 0
        if p in starts:  # a request begins: its leading run of cached blocks is its hit
            for b in requests[r]:
                if b not in held:
                    break
                gain += 1
        b = flat[p][1]
        if b in held:
            return gain + go(p + 1, held)
        best = go(p + 1, held)  # not kept
        if len(held) < capacity:
            best = max(best, go(p + 1, held | {b}))
        else:
            for v in held:
                best = max(best, go(p + 1, (held - {v}) | {b}))
        return gain + best

    return go(0, frozenset())


def test_optimal_equals_exhaustive_search() -> None:
    rng = random.Random(3)
    for _ in range(30):
        reqs = random_chains(rng, n=6, depth=3, fanout=2)
        s = stream_of(reqs)
        for cap in (1, 2, 3):
            best = best_prefix_hits(reqs, cap)
            got = optimal_hits(s.flat, s.offsets, cap)
            assert got["hits"] == best, (reqs, cap)
            assert got["block_hits"] == got["hits"]
            assert lru_hits(reqs, cap)["hits"] <= best
            assert kvstore_hits(s, cap)["hits"] <= best


# ---- workloads -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["chat", "docqa", "fewshot"])
def test_workloads_are_deterministic(name: str) -> None:
    a = list(make(name, seed=5, quiet=True, **SMALL[name]).requests())
    b = list(make(name, seed=5, quiet=True, **SMALL[name]).requests())
    c = list(make(name, seed=6, quiet=True, **SMALL[name]).requests())
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.arrival_s == y.arrival_s and x.output_len == y.output_len
        assert np.array_equal(x.prompt, y.prompt) and x.prompt.dtype == np.int32
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    assert any(not np.array_equal(x.prompt, y.prompt) for x, y in zip(a, c))
    w = make(name, seed=5, quiet=True, **SMALL[name])
    assert w.block_keys() == [KEYSPACE.block_keys(r.prompt) for r in a]


def test_workload_shapes() -> None:
    chat = list(make("chat", quiet=True, **SMALL["chat"]).requests())
    system = chat[0].prompt[:512]
    assert all(np.array_equal(r.prompt[:512], system) for r in chat)  # the shared system prompt
    doc = list(make("docqa", quiet=True, **SMALL["docqa"]).requests())
    assert all(2000 <= len(r.prompt) <= 3000 + 8 + 32 for r in doc)
    few = list(make("fewshot", quiet=True, **SMALL["fewshot"]).requests())
    assert all(np.array_equal(r.prompt[:1536], few[0].prompt[:1536]) for r in few)


def test_limits_and_scaling_line(capsys: pytest.CaptureFixture[str]) -> None:
    w = make("chat", seed=1, scale=0.25, sessions=30, max_requests=17)
    assert len(list(w.requests())) == 17
    err = capsys.readouterr().err
    assert "workload chat: token lengths x 0.25, first 17 requests" in err and "system prompt 512 tokens" in err
    w = make("docqa", docs=10, max_time_s=300.0, quiet=True)
    assert all(r.arrival_s < 300.0 for r in w.requests())
    list(make("fewshot", requests_n=5).requests())
    assert capsys.readouterr().err == ""  # unscaled: silent
    with pytest.raises(ValueError):
        make("nope")
    assert set(WORKLOADS) == {"chat", "docqa", "fewshot", "trace"}


@needs_trace
def test_trace_equal_ids_give_equal_tokens_and_keys(capsys: pytest.CaptureFixture[str]) -> None:
    w = Trace(tokens_per_hash_block=32, max_requests=300)
    reqs = list(w.requests())
    assert "32 tokens per hash block instead of 512" in capsys.readouterr().err
    recs = load_trace(w.path)[:300]
    assert len(reqs) == 300 and [r.arrival_s for r in reqs] == [r.arrival_s for r in recs]
    first = np.random.default_rng(recs[0].hash_ids[0]).integers(0, 32000, HASH_BLOCK_TOKENS, dtype=np.int32)
    assert np.array_equal(hash_block_tokens(recs[0].hash_ids[0], 32), first[:32])
    keys = w.block_keys()
    assert keys == [KEYSPACE.block_keys(r.prompt) for r in reqs]  # the per-id fast path is exact
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        a, b = recs[i].hash_ids, recs[j].hash_ids
        shared = 0  # leading ids in common, neither request's (cut) last block counted
        while shared < min(len(a), len(b)) - 1 and a[shared] == b[shared]:
            shared += 1
        assert shared >= 1  # the trace's first requests share hash id 0
        assert np.array_equal(reqs[i].prompt[: shared * 32], reqs[j].prompt[: shared * 32])
        assert keys[i][: shared * 2] == keys[j][: shared * 2]
        if a[shared] != b[shared] and min(len(keys[i]), len(keys[j])) > shared * 2:
            assert keys[i][shared * 2] != keys[j][shared * 2]  # different ids, different keys
    for r, rec in zip(reqs, recs):
        n = len(rec.hash_ids)
        assert (n - 1) * 32 < len(r.prompt) <= n * 32


@needs_trace
def test_trace_path_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 700, "output_length": 64, "hash_ids": [0, 1]}\n'
        '{"timestamp": 1500, "input_length": 512, "output_length": 64, "hash_ids": [0]}\n'
    )
    monkeypatch.setenv("KVSTORE_TRACE", str(p))
    w = Trace(tokens_per_hash_block=16, quiet=True)
    reqs = list(w.requests())
    # 700 tokens in 2 hash blocks -> 22 at 16 tokens a block; 512 in 1 -> 16.
    assert [len(r.prompt) for r in reqs] == [22, 16] and [r.arrival_s for r in reqs] == [0.0, 1.5]
    assert [r.output_len for r in reqs] == [2, 2]
    assert w.block_keys() == [KEYSPACE.block_keys(reqs[0].prompt), KEYSPACE.block_keys(reqs[1].prompt)]
    assert w.block_keys()[0][0] == w.block_keys()[1][0]
