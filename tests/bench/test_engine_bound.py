"""The TTFT bound of bench/engine_reuse.py: the compute term is measured on the engine with
exactly the prefix the store served in place, and both ratios come out of the same rows."""

import numpy as np
import pytest

from bench.engine_bound import measured_compute_s, ttft_over_bound

BS = 16


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def test_compute_of_a_suffix_with_its_prefix_in_place():
    p = prompt(6 * BS + 5, 1)
    full, suffix = measured_compute_s([p, p], [0, 6 * BS], model="tiny")
    assert full > 0 and suffix > 0
    # The same engine computes 5 tokens after a cached prefix faster than all 101 of them.
    assert suffix < full


def test_a_prefix_that_is_not_whole_blocks_is_refused():
    # Only whole blocks can be cached; a bound for 3 cached tokens would be a bound for 0.
    with pytest.raises(RuntimeError, match="expected 3"):
        measured_compute_s([prompt(40, 2)], [3], model="tiny")


def test_ratios_from_rows():
    p = prompt(4 * BS + 3, 3)
    rows = [
        {"status": 200, "ttft_ms": 50.0, "tokens_loaded": 4 * BS, "tokens_cached": 0, "tokens_computed": 3,
         "load_ms": 2.0, "worker_ttft_ms": 45.0},
        {"status": 502, "ttft_ms": 1.0},  # a failed request is left out
    ]  # fmt: skip
    r = ttft_over_bound(rows, [p, p], flat_tps=1000.0, bw=1e9, block_bytes=1 << 20, model="tiny")
    load_s = 4 * (1 << 20) / 1e9
    assert r["bound_load_ms_mean"] == pytest.approx(load_s * 1000, abs=0.01)
    assert r["ttft_over_flat_bound"] == pytest.approx(0.050 / (0.003 + load_s), rel=1e-3)
    bound_s = r["bound_compute_ms_mean"] / 1000 + load_s
    assert r["ttft_over_bound"] == pytest.approx(0.050 / bound_s, rel=2e-3)
    assert r["load_ms_mean"] == 2.0 and r["worker_ttft_ms_mean"] == 45.0
