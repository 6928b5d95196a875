"""bench/meta_memory.py on a small pool: each point runs a real service and daemon, stores every
block it puts, finds every key it looks up, and the report carries the figures."""

from __future__ import annotations

import pytest

from bench import meta_memory


@pytest.mark.parametrize("kind", ["object", "compact"])
def test_a_point_stores_every_block_and_reads_the_service_memory(monkeypatch, tmp_path, kind: str) -> None:  # noqa: ANN001
    monkeypatch.setattr(meta_memory, "BATCH", 256)
    monkeypatch.setattr(meta_memory, "LOOKUPS", 5)
    monkeypatch.setattr(meta_memory, "LOOKUP_KEYS", 100)
    r = meta_memory.point(kind, 2048, tmp_path)  # raises unless every block was stored and found
    assert r["index"] == kind and r["blocks"] == 2048
    assert r["rss_after_bytes"] >= r["rss_base_bytes"] > 0
    assert r["put_blocks_per_s"] > 0 and 0 < r["lookup_1000_p50_ms"] <= r["lookup_1000_p99_ms"]


def test_the_report_names_both_indexes_and_their_ratio() -> None:
    rows = [
        {"index": k, "blocks": 10, "service_bytes_per_block": b, "put_blocks_per_s": 5, "lookup_1000_p50_ms": 1,
         "lookup_1000_p99_ms": 2}
        for k, b in (("object", 700.0), ("compact", 140.0))
    ]  # fmt: skip
    text = meta_memory.report(
        {"command": "c", "date": "d", "machine": "m", "blocks": 10, "rows": rows,
         "object_over_compact_bytes": 5.0, "compact_over_object_put_rate": 1.0}
    )  # fmt: skip
    assert "| object | 10 | **700** |" in text and "| compact | 10 | **140** |" in text and "**5.0x**" in text
