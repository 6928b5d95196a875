"""bench/index_scale.py on small indexes: each point measures what it says, and the report
judges the targets from the figures."""

from __future__ import annotations

import pytest

from bench import index_scale


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_scale, "STEADY", 2000)
    monkeypatch.setattr(index_scale, "LOOKUPS", 20)


@pytest.mark.parametrize("kind", ["lru", "adaptive"])
def test_a_point_fills_looks_up_and_evicts(small: None, kind: str) -> None:
    r = index_scale.point(kind, 5000)
    assert r["index"] == kind and r["blocks"] == 5000
    assert 0 < r["bytes_per_block"] < 5000
    assert 0 < r["lookup_p50_ms"] <= r["lookup_p99_ms"]
    assert r["ref_lookup_p50_ms"] > 0 and r["lookup_over_ref"] == pytest.approx(
        r["lookup_p50_ms"] / r["ref_lookup_p50_ms"]
    )
    assert r["put_commit_blocks_per_s"] > 0
    assert 0 < r["table_bytes_per_block"] < r["bytes_per_block"] + 1
    assert r["drop_steps"] >= 2 and 0 < r["drop_step_p50_ms"] <= r["drop_step_max_ms"] <= r["drop_s"] * 1e3


DROP = {"drop_steps": 3, "drop_step_p50_ms": 1.0, "drop_step_max_ms": 2.0, "drop_s": 0.004}


def test_figures_and_report_judge_the_targets(tmp_path) -> None:  # noqa: ANN001
    rows = [
        {"index": "lru", "blocks": 10_000, "bytes_per_block": 150.0, "lookup_p50_ms": 0.2,
         "lookup_p99_ms": 0.3, "ref_lookup_p50_ms": 0.2, "lookup_over_ref": 1.0, "put_commit_blocks_per_s": 5e4, "fill_blocks_per_s_traced": 2e4, **DROP},
        {"index": "lru", "blocks": 10_000_000, "bytes_per_block": 80.0, "lookup_p50_ms": 0.4,
         "lookup_p99_ms": 0.9, "ref_lookup_p50_ms": 0.2, "lookup_over_ref": 2.0, "put_commit_blocks_per_s": 3e4, "fill_blocks_per_s_traced": 2e4,
         "drop_steps": 400, "drop_step_p50_ms": 20.0, "drop_step_max_ms": 61.5, "drop_s": 8.0},
        {"index": "adaptive", "blocks": 10_000, "bytes_per_block": 680.0, "lookup_p50_ms": 0.15,
         "lookup_p99_ms": 0.2, "ref_lookup_p50_ms": 0.15, "lookup_over_ref": 1.0, "put_commit_blocks_per_s": 8e4, "fill_blocks_per_s_traced": 2e4, **DROP},
    ]  # fmt: skip
    f = index_scale.figures(rows)
    assert f["index_bytes_per_block"] == 80.0
    assert f["lookup_10m_over_10k"] == pytest.approx(2.0)
    text = index_scale.report({"command": "c", "date": "d", "machine": "m", "points": rows, "figures": f})
    assert "`index_bytes_per_block` = **80.00** (target <= 128: met)" in text
    assert "`lookup_10m_over_10k` = **2.00** (target <= 1.5: missed)" in text
    assert f["drop_step_max_ms_10m"] == 61.5 and "| 400, 20.0 / 61.5, 8.00 |" in text
    assert index_scale.plot(rows, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 0
