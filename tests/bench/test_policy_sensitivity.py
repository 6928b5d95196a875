"""The policy-sensitivity benchmark: a parameter set there reaches the index's policy (and no
other index), and a small run gives well-formed rows and a report."""

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


def test_a_parameter_set_reaches_the_index_policy_and_its_duel_only() -> None:
    idx = P.make_index(200, params=S.params_of(3, 7, 5, frequency_only=True))
    pol = idx.policy
    assert (pol.params.age_factor, pol.params.history_factor, pol.params.sample) == (3, 7, 5)
    assert pol.params.window_factor == 12 and pol.params.fixed_mode == "frequency"
    assert pol.duel.params is pol.params and pol.duel.shadows[1].params is pol.params
    # Another index made meanwhile keeps the defaults: nothing global was changed.
    other = P.make_index(200).policy.params
    assert (other.age_factor, other.history_factor, other.sample, other.window_factor) == (10, 10, 64, 40)
    assert S.DEFAULTS == {"age": 10, "history": 10, "sample": 64}


def test_an_aging_period_set_there_is_the_one_the_index_ages_by() -> None:
    stream = P.Stream.from_workload(make("chat", seed=P.SEED, **SMALL["chat"]))
    epochs = {}
    for age in (2, 40):
        index = P.make_index(200, params=S.params_of(age, 10, 64, frequency_only=True))
        out = P.kvstore_hits(stream, 200, index=index)
        assert out["policy_frequency_keys"] > 0.99 * stream.refs
        epochs[age] = out["policy_epoch"]
    # Counts halve every age_factor x max(1024, blocks indexed) accesses, counted a request at
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
    assert "Fitted to the trace" in text and "| age_factor |" in text
