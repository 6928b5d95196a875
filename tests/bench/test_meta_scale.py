"""bench/meta_scale.py at two tiny sizes: real service and daemon processes are filled, looked
up, killed and restarted, and the results file carries every figure, each positive; nothing is
left running or in /dev/shm."""

from __future__ import annotations

import glob
import json
import os

import pytest

from bench import meta_scale

pytestmark = pytest.mark.timeout(240)

PER_SIZE = (
    "fill_blocks_per_s_{t}", "meta_rss_bytes_per_block_{t}", "daemon_rss_bytes_per_block_{t}",
    "lookup1000_p50_{t}", "lookup1000_p99_{t}", "one_key_lookups_{t}", "restart_{t}_s", "daemon_restart_{t}_s",
)  # fmt: skip


def test_a_small_run_writes_every_figure(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setattr(meta_scale, "LOOKUPS", 20)
    monkeypatch.setattr(meta_scale, "ONE_KEY", 500)
    monkeypatch.setattr(meta_scale, "SAMPLE", 500)
    monkeypatch.setattr(meta_scale, "SETTLE_S", 0.5)
    out = tmp_path / "meta_scale.json"
    assert meta_scale.main(["--sizes", "2000,5000", "--timeout", "60", "--no-report", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["timed_out"] == [] and r["daemons_dropped"] == 0
    assert [p["blocks"] for p in r["points"]] == [2000, 5000]
    for t in ("2k", "5k"):
        for name in PER_SIZE:
            v = r[name.format(t=t)]
            assert isinstance(v, (int, float)) and v > 0, (name.format(t=t), v)
    assert r["fill_blocks_per_s"] == r["fill_blocks_per_s_5k"]
    for p in r["points"]:  # the service's event loop, watched through every phase
        assert p["loop_max_hold_ms"] >= 0 and r[f"loop_max_hold_ms_{meta_scale.label(p['blocks'])}"] >= 0
        assert {"loop_max_hold_ms_fill", "loop_max_hold_ms_restart"} <= set(p)
    assert r["lookup1000_p99_5k_over_2k"] > 0 and r["one_key_lookups_5k_over_2k"] > 0
    for p in r["points"]:
        t = meta_scale.label(p["blocks"])
        assert p["lookup1000_p50_ms"] <= p["lookup1000_p99_ms"]
        assert p[f"restart_{t}_keys"] == p[f"daemon_restart_{t}_keys"] == p["blocks"]
        assert p[f"restart_{t}_read_back"] == p[f"daemon_restart_{t}_read_back"] == 500
        assert set(p["fill_cpu_us_per_block"]) == {"client", "meta", "daemon"}
    assert out.with_suffix(".png").stat().st_size > 0
    assert not glob.glob(f"/dev/shm/kvstore-scale-{os.getpid()}-*")


def test_labels_ratios_and_plot(tmp_path) -> None:  # noqa: ANN001
    assert [meta_scale.label(n) for n in (2000, 10_000, 1_000_000, 10_000_000, 12_345)] == [
        "2k", "10k", "1m", "10m", "12345",
    ]  # fmt: skip
    pts = [
        {"blocks": n, "timed_out": [], "lookup1000_p99_ms": p99, "one_key_lookups_per_s": rate}
        for n, p99, rate in ((10_000, 0.5, 10_000), (1_000_000, 0.6, 9_000), (10_000_000, 1.0, 8_000))
    ]
    pts[2]["timed_out"] = ["restart"]
    s = meta_scale.summary(pts)
    assert s["lookup1000_p99_10m_over_10k"] == 2.0 and s["one_key_lookups_10m_over_10k"] == 0.8
    assert s["lookup1000_p99_1m_over_10k"] == 1.2
    assert s["timed_out"] == ["restart_10m"] and s["restart_10m_s"] is None
    pts[0]["restart_10k_s"] = 3.0
    assert meta_scale.plot(pts, tmp_path / "p.png", 600) and (tmp_path / "p.png").stat().st_size > 0
