"""The metadata service over its block table, with real processes: a configuration that asks for
a cache policy the service does not have is refused at start, the service's state and metrics
are read from the table, and a put whose rows are given to another put while it waits keeps its
own extents."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import REPO, Cluster, wait_until

from kvstore import SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.errors import Internal
from tests.integration.test_roundtrip import KS, blocks


def test_an_unknown_cache_policy_is_refused_at_start(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "meta", "--listen", "127.0.0.1:0",
         "--set", "meta.cache_policy=lfu"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert "meta.cache_policy" in out.stderr and "adaptive" in out.stderr


def test_service_state_and_metrics_read_from_the_block_table(cluster: Cluster) -> None:
    from tests.integration.test_observability import scrape, value

    p = cluster.start_meta("meta.metrics_port=0")
    cluster.start_daemon()
    keys = KS.block_keys(list(range(8 * 16)))[:8]
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(keys, blocks(8, 4096, seed=3)).stored == 8
        assert c.pin(keys[:3]) == 3
        st = c.stats()
        assert st.keys == 8 and st.segments[0].blocks == 8 and st.segments[0].pinned_blocks == 3
    m = scrape(p.info["metrics_port"])
    assert value(m, "kvstore_meta_keys") == 8
    assert value(m, "kvstore_meta_segment_pinned_blocks") == 3
    assert value(m, "kvstore_meta_policy_frequency_mode") == 0
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{p.info['metrics_port']}/metrics", timeout=10) as r:
        assert "while the adaptive cache policy" in r.read().decode()


def test_a_put_whose_rows_are_given_to_another_while_it_waits_keeps_its_own_extents(cluster: Cluster) -> None:
    """PutStart waits for a stopped daemon to drop what eviction took from it; meanwhile that
    daemon's lease lapses, its blocks (the waiting put's new ones too) leave the index, and their
    rows go to another writer's put on another daemon. The waiting put is answered with its own
    extents, not the other writer's: the other writer's blocks read back whole."""
    import os
    import signal
    import threading

    cluster.start_meta()
    d1 = cluster.start_daemon(dram="1MiB", name="d1", host_id="hA")
    size = 256 << 10
    keys = KS.block_keys(list(range(16 * 16)))[:16]
    data = blocks(len(keys), size, seed=3)
    first = SyncKVStoreClient(cluster.meta_addr, ClientConfig(host_id="hB", rpc_timeout_s=30))
    try:
        assert first.put(keys[:8], data[:8]).stored > 0  # d1 full: the next put evicts there
        os.kill(d1.p.pid, signal.SIGSTOP)
        out: dict = {}

        def waiting_put() -> None:
            try:
                out["put"] = first.put(keys[8:9], data[8:9])
            except Exception as e:  # noqa: BLE001 - any typed error is an answer; checked below
                out["put"] = e

        th = threading.Thread(target=waiting_put)
        th.start()
        cluster.start_daemon(dram="8MiB", name="d2", host_id="hB")
        wait_until(lambda: "d1" not in [d.info.daemon_id for d in first.stats().daemons], timeout=15)
        with SyncKVStoreClient(cluster.meta_addr, ClientConfig(host_id="hB")) as other:
            assert other.put(keys[10:16], data[10:16]).stored == 6
            th.join(60)
            assert not th.is_alive()
            assert not isinstance(out["put"], Internal), out["put"]
            got = [np.zeros(size, np.uint8) for _ in range(6)]
            assert other.get_into(keys[10:16], got) == 6
            assert all(np.array_equal(a, b) for a, b in zip(got, data[10:16]))
    finally:
        os.kill(d1.p.pid, signal.SIGCONT)
        first.close()
