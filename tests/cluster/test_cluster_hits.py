"""Hit counters in a sharded cluster (Redis, 2 metadata shards, a daemon, all separate
processes): each shard counts its own keys of every get, once, as the reader loaded them, so
that the shards' /metrics summed and `kvstore stat --json` equal what the clients counted,
also where a chain's keys past its first miss are stored on another shard."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvstore.client import SyncKVStoreClient
from kvstore.cluster.slots import SlotMap
from kvstore.cluster.testbed import Testbed
from tests.conftest import REPO
from tests.integration.test_hit_counts import FIELDS, from_metrics, from_stat, settled
from tests.integration.test_observability import scrape

pytestmark = pytest.mark.timeout(180)

BLOCK = 8192


def test_each_shard_counts_its_keys_of_every_get_once(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    rng = np.random.default_rng(7)
    with Testbed(tmp_path, sets=("meta.metrics_port=0",)) as tb:
        tb.start_redis()
        tb.start_shards(2, standby=False)
        tb.start_daemon(0, name="da")
        smap = SlotMap.even(2)
        chains = []
        while len(chains) < 5:  # chains whose keys lie on both shards
            keys = [rng.bytes(16) for _ in range(6)]
            if {smap.shard_of(k) for k in keys} == {0, 1}:
                chains.append((keys, [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in keys]))
        # A chain with a hole: its third key (on shard 1) is removed; the keys after it stay stored,
        # two of them on shard 0 behind the chain's first key, so that shard 0's run passes the
        # chain's first miss.
        holed = []
        for want in (0, 1, 1, 0, 0, 1):
            k = rng.bytes(16)
            while smap.shard_of(k) != want:
                k = rng.bytes(16)
            holed.append(k)
        holed_data = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in holed]
        chains.append((holed, holed_data))
        other = [rng.bytes(16) for _ in range(5)]
        hits = misses = 0

        def get(c: SyncKVStoreClient, keys: list[bytes], data: list[np.ndarray] | None, stored: int) -> None:
            nonlocal hits, misses
            out = [np.zeros(BLOCK, np.uint8) for _ in keys]
            n = c.get_into(keys, out)
            assert n == stored
            assert data is None or all((o == d).all() for o, d in zip(out[:n], data))
            hits += n
            misses += len(keys) - n

        clients = [
            SyncKVStoreClient(config=tb.client_config()),
            SyncKVStoreClient(config=tb.client_config(location_cache=0)),
        ]
        try:
            w, cold = clients
            for keys, data in chains:
                assert w.put(keys, data).stored == 6
            for c in clients:
                for _ in range(2):
                    for keys, data in chains:
                        get(c, keys, data, 6)
                get(c, other, None, 0)
                get(c, chains[1][0][:4] + other[:2], chains[1][1], 4)
            assert w.remove([holed[2]]) == 1
            for c in clients:
                get(c, holed, holed_data, 2)
            want = dict.fromkeys(FIELDS, 0)
            for c in clients:
                for f in FIELDS:
                    want[f] += c.read_stats()[f]
            assert (want["hit_keys"], want["miss_keys"]) == (hits, misses)
            assert w.read_stats()["known_hit_keys"] > 0

            members = w.cluster_state()["members"]
            ports = [m["metrics_port"] for m in members if m.get("role") == "leader"]
            assert len(ports) == 2

            def summed() -> dict[str, int]:
                per = [from_metrics(scrape(port)) for port in ports]
                assert all(p["hit_keys"] > 0 for p in per), "each shard counts its own keys"
                return {f: sum(p[f] for p in per) for f in FIELDS}

            settled(summed, want, 0.05)
            out = subprocess.run(
                [sys.executable, "-m", "kvstore.cli", "stat", "--json", "--redis", tb.redis_url,
                 "--set", f"cluster.name={tb.name}"],
                capture_output=True, text=True, timeout=60, cwd=REPO, check=True,
            ).stdout  # fmt: skip
            import json

            assert from_stat(json.loads(out)) == want
        finally:
            for c in clients:
                c.close()
