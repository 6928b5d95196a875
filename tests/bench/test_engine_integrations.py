"""The vLLM integration benchmark's workload and report (its runs are measured by the benchmark
itself; the connector's behaviour is tested in tests/integrations/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import engine_integrations as ei  # noqa: E402


def test_the_workload_shares_a_system_prompt_and_grows_each_session():
    w = ei.workload(ei.QUICK)
    p = ei.QUICK
    assert len(w["users"]) == p["turns"] and all(len(t) == p["sessions"] for t in w["users"])
    first = w["users"][0]
    assert all(u[: p["system"]] == first[0][: p["system"]] for u in first)  # one shared system prompt
    assert len({tuple(u[p["system"] :]) for u in first}) == p["sessions"]  # distinct user messages
    assert all(len(u) == p["user"] for t in w["users"][1:] for u in t)
    assert all(3 <= x < 3 + ei.MODEL["vocab_words"] for t in w["users"] for u in t for x in u)
    assert ei.workload(ei.QUICK) == w  # seeded


def test_the_report_names_its_figures_and_says_what_was_not_measured():
    runs = {
        k: {"ttft_s": [0.01 * (i + 1) for i in range(4)], "cached": [0, 32, 64, 0], "prompts": [[1] * 70] * 4,
            "stats": {"tokens_loaded": 64 if k != "vllm" else 0}}
        for k in ("recompute", "vllm", "kvstore", "second")
    }  # fmt: skip
    res = {"systems": {k: ei.summary(r) for k, r in runs.items()}, "workload": ei.QUICK, "machine": "m",
           "date": "d", "vllm": "0.32.0", "vllm_ttft_kvstore_over_vllm": 0.5, "vllm_ttft_kvstore_over_recompute": 0.2,
           "vllm_cross_instance_hit_tokens": 1.0, "vllm_cross_instance_kvstore_tokens": 0.5,
           "vllm_ttft_kvstore_over_lmcache": None, "lmcache": "not measured: reason"}  # fmt: skip
    assert res["systems"]["kvstore"]["prefill_tokens_computed"] == 4 * 70 - 96
    text = ei.report(res, "python bench/engine_integrations.py")
    for field in ("vllm_ttft_kvstore_over_vllm", "vllm_cross_instance_hit_tokens", "vllm_ttft_kvstore_over_lmcache"):
        assert field in text
    assert "not measured: reason" in text
    json.dumps(res)
