"""The policy-robustness benchmark: each reshaped variant is what it says it is, and a small run
gives well-formed rows and a report."""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import policy as P  # noqa: E402
from bench import policy_variants as V  # noqa: E402
from bench.workloads import find_trace, make  # noqa: E402

try:
    find_trace()
    HAVE_TRACE = True
except FileNotFoundError:
    HAVE_TRACE = False
pytestmark = pytest.mark.skipif(not HAVE_TRACE, reason="conversation trace not found (set KVSTORE_TRACE)")


@cache
def small_trace() -> tuple[tuple[bytes, ...], ...]:
    w = make("trace", seed=P.SEED, tokens_per_hash_block=32, max_requests=400)
    return tuple(tuple(ks) for ks in w.block_keys())


@pytest.fixture
def variants(monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setattr(V, "_trace_keys", small_trace)
    return {name: build()[0] for name, build in V.variants().items() if name.startswith("trace_")}


def test_each_variant_is_what_it_says(variants: dict) -> None:
    base = [list(ks) for ks in small_trace()]
    n = len(base)
    assert variants["trace_first_half"] + variants["trace_second_half"] == base
    per_hash = 2  # 32 tokens per hash block, 16 per store block
    assert P.FULL["trace"]["tokens_per_hash_block"] == 32
    assert variants["trace_no_shared_head"] == [ks[per_hash:] for ks in base if len(ks) > per_hash]
    # Shuffled: the same requests, each within its window.
    shuffled = variants["trace_shuffled"]
    assert shuffled != base
    for i in range(0, n, V.SHUFFLE_WINDOW):
        assert sorted(shuffled[i : i + V.SHUFFLE_WINDOW]) == sorted(base[i : i + V.SHUFFLE_WINDOW])
    # Two tenants: the trace on even requests; on odd ones a rotated copy under keys of its own,
    # with the same reuse structure.
    two = variants["trace_two_tenants"]
    assert two[0::2] == base
    own = {k for ks in base for k in ks}
    assert not own & {k for ks in two[1::2] for k in ks}
    third = n // 3
    rotated = P.Stream.from_keys("r", base[third:] + base[:third])
    assert np.array_equal(P.Stream.from_keys("o", two[1::2]).flat, rotated.flat)
    # Counter keys: the same stream of blocks (first-use ids equal), named 1, 2, 3, ...
    counters = variants["trace_counter_keys"]
    assert np.array_equal(P.Stream.from_keys("c", counters).flat, P.Stream.from_keys("b", base).flat)
    assert counters[0][0] == (1).to_bytes(16, "big")
    assert max(int.from_bytes(k, "big") for ks in counters for k in ks) == len(own)


def test_small_run_is_well_formed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(V, "_trace_keys", small_trace)
    names = ["trace_counter_keys", "trace_no_shared_head"]
    r = V.run(names, [50, 400], jobs=1, progress=False)
    assert set(r["variants"]) == set(names)
    for v in r["variants"].values():
        assert [row["capacity"] for row in v["rows"]] == [50, 400]
        for row in v["rows"]:
            h = row["hit_rates"]
            assert set(h) == set(V.POLICIES)
            assert all(0.0 <= x <= h["optimal"] + 1e-9 for x in h.values()), h  # MIN bounds them all
            assert row["below_lru"] == pytest.approx(h["lru"] - h["kvstore"], abs=1e-4)
            assert row["meets_lru_floor"] == (row["below_lru"] <= P.LRU_FLOOR)
            assert 0.0 <= row["frequency_key_share"] <= 1.0
    worst = r["worst_below_lru"]
    assert worst["below_lru"] == max(row["below_lru"] for v in r["variants"].values() for row in v["rows"])
    r.update(command="python bench/policy_variants.py", date="today", machine="here", wall_s=1.0)
    text = V.render(r, "x.png")
    verdict = "yes" if r["floor_met_everywhere"] else "no"
    assert f"floor met everywhere: **{verdict}**" in text
    assert "trace_counter_keys" in text and "results/x.png" in text
    r["variants"]["trace_counter_keys"]["rows"][0].update(meets_lru_floor=False)
    r["floor_met_everywhere"] = False
    assert "**below floor**" in V.render(r, None) and "floor met everywhere: **no**" in V.render(r, None)
