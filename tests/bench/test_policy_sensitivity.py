"""The policy-sensitivity benchmark: a parameter set there reaches the index's policy (and is put
back), and a small run gives well-formed rows and a report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import policy as P  # noqa: E402
from bench import policy_sensitivity as S  # noqa: E402
from bench.workloads import find_trace, make  # noqa: E402
from kvstore.meta import compact_policy, counts, duel  # noqa: E402
from kvstore.meta import policy as index_policy  # noqa: E402

SMALL = {
    "chat": {"scale": 0.25, "sessions": 40, "duration_s": 600.0},
    "docqa": {"scale": 0.25, "docs": 16, "duration_s": 600.0},
    "trace": {"tokens_per_hash_block": 16, "max_requests": 300},
}


def _trace_available() -> bool:
    try:
        find_trace()
        return True
    except FileNotFoundError:
        return False


def test_parameters_reach_every_module_and_are_put_back() -> None:
    before = (duel.AGE_FACTOR, duel.HISTORY_FACTOR, duel.SAMPLE, duel.WINDOW_FACTOR, counts.Duel)
    with S.parameters(3, 7, 5, frequency_only=True):
        assert (duel.AGE_FACTOR, counts.AGE_FACTOR, duel.WINDOW_FACTOR) == (3, 3, 12)
        assert (duel.HISTORY_FACTOR, counts.HISTORY_FACTOR) == (7, 7)
        assert duel.SAMPLE == index_policy.SAMPLE == compact_policy.SAMPLE == 5
        assert counts.Duel is S._FrequencyOnly
    assert (duel.AGE_FACTOR, duel.HISTORY_FACTOR, duel.SAMPLE, duel.WINDOW_FACTOR, counts.Duel) == before
    assert counts.AGE_FACTOR == counts.HISTORY_FACTOR == 10 and index_policy.SAMPLE == compact_policy.SAMPLE == 64


def test_an_aging_period_set_there_is_the_one_the_index_ages_by() -> None:
    stream = P.Stream.from_workload(make("chat", seed=P.SEED, **SMALL["chat"]))
    epochs = {}
    for age in (2, 40):
        with S.parameters(age, 10, 64, frequency_only=True):
            out = P.kvstore_hits(stream, 200)
        assert out["policy_frequency_keys"] > 0.99 * stream.refs
        epochs[age] = out["policy_epoch"]
    # Counts halve every AGE_FACTOR x max(1024, blocks indexed) accesses, counted a request at
    # a time (a period ends at the request that reaches it).
    longest = max(len(p) // 16 for p in stream.packed)
    for age, n in epochs.items():
        assert stream.refs // (age * 1024 + longest) <= n <= stream.refs // (age * 1024), (age, n)
    assert epochs[2] > 4 * epochs[40]


@pytest.mark.skipif(not _trace_available(), reason="conversation trace not found (set KVSTORE_TRACE)")
def test_a_small_run_is_well_formed_and_renders() -> None:
    streams = {n: P.Stream.from_workload(make(n, seed=P.SEED, **kw)) for n, kw in SMALL.items()}
    r = S.run(quick=True, jobs=1, progress=False, streams=streams)
    assert r["points"] == [f"{n}:{c}" for n, c in S.QUICK_POINTS]
    for param, rows in r["one_at_a_time"].items():
        assert [row["value"] for row in rows] == S._values(param)
        default = next(row for row in rows if row["value"] == S.DEFAULTS[param])
        assert default["hit_rates"] == r["default_hit_rates"]  # the same replay, so the same hits
        for row in rows:
            for p in r["points"]:
                assert 0.0 <= row["hit_rates"][p] <= 1.0
    fit = r["fit"]
    assert len(fit["grid"]) == len(list(S.QUICK_GRID["age"])) * len(S.QUICK_GRID["history"]) * len(
        S.QUICK_GRID["sample"]
    )
    assert fit["best"]["hit_rate"] == max(g["hit_rate"] for g in fit["grid"])
    assert fit["at_defaults"] is not None
    # No online policy beats MIN with bypass.
    assert fit["best"]["hit_rate"] <= fit["optimal_hit_rate"]
    text = S.render({"command": "x", "date": "d", "machine": "m", "wall_s": 1.0, **r}, None)
    assert "Fitted to the trace" in text and "| AGE_FACTOR |" in text
