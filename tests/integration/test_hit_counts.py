"""The hit counters count every get, with real processes: reads under a lease (Acquire), reads
from known locations over shared memory and over TCP (told to the service by Touch), reads that
miss, partial hits, known locations found stale, and blocks read from SSD. Once the touch
interval has passed, ``hit_keys``, ``miss_keys``, ``hit_bytes`` and the per-tier hits on /metrics
(parsed) and in ``kvstore stat --json`` equal what the clients counted themselves."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig
from tests.conftest import REPO, wait_until
from tests.integration.test_observability import scrape, value

KS = KeySpace(ModelFingerprint("hit-counts", "bf16", 2, 2, 64))
FIELDS = ("hit_keys", "miss_keys", "hit_bytes", "dram_hit_keys", "ssd_hit_keys")


def chain(n: int, start: int) -> list[bytes]:
    return KS.block_keys(np.arange(start, start + 16 * n))


def payload(key: bytes, size: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, size, dtype=np.uint8)


class Reader:
    """A client and what its gets returned, counted by the test from the return values."""

    def __init__(self, meta: str, size: int, **cfg: object) -> None:
        self.c = SyncKVStoreClient(meta, ClientConfig(**cfg))
        self.size = size
        self.hits = self.misses = 0

    def get(self, keys: list[bytes], stored: int) -> None:
        """Reads ``keys``, of which the first ``stored`` are in the store."""
        out = [np.zeros(self.size, np.uint8) for _ in keys]
        n = self.c.get_into(keys, out)
        assert n == stored
        assert all(np.array_equal(o, payload(k, self.size)) for o, k in zip(out[:n], keys))
        self.hits += n
        self.misses += len(keys) - n


def totals(readers: list[Reader]) -> dict[str, int]:
    """What the clients counted, summed; checked against the test's own count first."""
    out = dict.fromkeys(FIELDS, 0)
    for r in readers:
        mine = r.c.read_stats()
        assert (mine["hit_keys"], mine["miss_keys"]) == (r.hits, r.misses)
        assert mine["dram_hit_keys"] + mine["ssd_hit_keys"] == mine["hit_keys"]
        for f in FIELDS:
            out[f] += mine[f]
    return out


def stat_json(*args: str) -> dict:
    res = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "stat", "--json", *args],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=True,
    )  # fmt: skip
    return json.loads(res.stdout)


def from_metrics(m: dict) -> dict[str, int]:
    dram = value(m, "kvstore_meta_hits_total", tier="dram")
    ssd = value(m, "kvstore_meta_hits_total", tier="ssd")
    return {
        "hit_keys": int(dram + ssd),
        "miss_keys": int(value(m, "kvstore_meta_misses_total")),
        "hit_bytes": int(value(m, "kvstore_meta_hit_bytes_total")),
        "dram_hit_keys": int(dram),
        "ssd_hit_keys": int(ssd),
    }


def from_stat(s: dict) -> dict[str, int]:
    c = {k: int(v) for k, v in s["counters"].items()}
    return {
        "hit_keys": c["hit_keys"],
        "miss_keys": c["miss_keys"],
        "hit_bytes": c["hit_bytes"],
        "dram_hit_keys": c["hit_keys"] - c["ssd_hit_keys"],
        "ssd_hit_keys": c["ssd_hit_keys"],
    }


def settled(read_counts, want: dict[str, int], interval_s: float) -> None:  # noqa: ANN001
    """Waits until the service's counts reach ``want``, then checks they stay there (nothing is
    counted twice once the last Touch is in)."""
    wait_until(lambda: read_counts()["hit_keys"] >= want["hit_keys"], timeout=15)
    time.sleep(4 * interval_s)
    assert read_counts() == want


def test_hits_from_leases_known_locations_and_misses_are_each_counted_once(cluster):
    size = 64 << 10
    p = cluster.start_meta("meta.metrics_port=0")
    cluster.start_daemon()
    cluster.wait_served()
    meta = cluster.meta_addr
    a, b, missing = chain(8, 0), chain(4, 1000), chain(4, 2000)
    writer = Reader(meta, size)  # shared memory
    tcp = Reader(meta, size, transport="tcp")
    cold = Reader(meta, size, location_cache=0)  # every get through a lease
    readers = [writer, tcp, cold]
    try:
        assert writer.c.put(a + b, [payload(k, size) for k in a + b]).stored == 12
        for _ in range(3):
            writer.get(a, 8)  # its own puts' locations, over shared memory
        writer.get(missing, 0)
        for _ in range(3):
            tcp.get(a, 8)  # a lease, then known locations over TCP
        tcp.get(a[:5] + missing[:3], 5)  # known run, then an Acquire that misses
        tcp.get(b, 4)
        for _ in range(2):
            cold.get(a, 8)
        cold.get(a[:3] + missing[:2], 3)
        # Known locations found stale: the block is gone, the leased path misses it once.
        assert writer.c.remove(b) == 4
        tcp.get(b, 0)
        assert writer.c.put(b, [payload(k, size) for k in b]).stored == 4
        tcp.get(b, 4)
        want = totals(readers)
        assert writer.c.read_stats()["known_hit_keys"] == 24
        assert tcp.c.read_stats()["known_hit_keys"] >= 16 + 5
        assert want["hit_keys"] == 24 + 24 + 5 + 4 + 16 + 3 + 4 and want["ssd_hit_keys"] == 0
        assert want["miss_keys"] == 4 + 3 + 2 + 4
        assert want["hit_bytes"] == want["hit_keys"] * size

        # Counted while the clients are still open, once their touch interval has passed.
        mport = p.info["metrics_port"]
        settled(lambda: from_metrics(scrape(mport)), want, 0.05)
        s = stat_json("--meta", meta)
        assert from_stat(s) == want
        assert s["touch_interval_ms"] == 50
        assert value(scrape(mport), "kvstore_meta_touch_interval_seconds") == 0.05
        table = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "stat", "--meta", meta],
            capture_output=True, text=True, timeout=60, cwd=REPO, check=True,
        ).stdout  # fmt: skip
        assert f"({want['hit_keys']} hit / {want['miss_keys']} miss keys on get" in table
        assert "counted up to 50 ms late" in table
    finally:
        for r in readers:
            r.c.close()
    assert from_metrics(scrape(p.info["metrics_port"])) == want  # closing sent nothing more


def test_hits_are_counted_by_the_tier_read(cluster):
    """Blocks demoted to SSD and read from there (under a lease, then from known locations,
    some promoted meanwhile) count as SSD hits as the client read them."""
    size = 256 << 10
    cluster.start_meta("meta.dram_high_watermark=0.7", "meta.dram_low_watermark=0.5")
    cluster.start_daemon("daemon.ssd_bytes=64MiB", dram="4MiB")
    chains = [chain(4, 10_000 + 1000 * i) for i in range(10)]  # 10 MiB over 4 MiB of DRAM
    with SyncKVStoreClient(cluster.meta_addr) as c:
        for keys in chains:
            res = c.put(keys, [payload(k, size) for k in keys])
            assert res.stored == 4
        wait_until(lambda: c.stats().counters["demoted"] > 0)
        wait_until(lambda: sum(s.used_bytes for s in c.stats().segments if s.tier == 1) <= 0.7 * (4 << 20))
    reader = Reader(cluster.meta_addr, size, touch_interval_s=0.2)
    try:
        for _ in range(3):
            for keys in chains:
                reader.get(keys, 4)
        want = totals([reader])
        assert want["ssd_hit_keys"] > 0 and want["dram_hit_keys"] > 0
        assert reader.c.read_stats()["known_hit_keys"] > 0
        settled(lambda: from_stat(stat_json("--meta", cluster.meta_addr)), want, 0.2)
        assert stat_json("--meta", cluster.meta_addr)["touch_interval_ms"] == 200
    finally:
        reader.c.close()
