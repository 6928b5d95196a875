"""The metadata service on the compact index (``meta.index=compact``), with real processes: the
round trips, eviction order, faults, restarts and tier moves (demotion under pressure, promotion
on reads, gets racing both, a damaged SSD block, a daemon killed mid-burst) that the service's
own tests run on the object index, run again here on a service whose every block is a row of the
block table (kvstore.meta.compact); plus a configuration that asks for a policy the compact
index does not have is refused, and the service's state and metrics read from the table."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, Cluster, wait_until

from kvstore import SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.errors import Internal

# The same tests, collected again in this module, where every service they start runs the compact
# index (this module's ``cluster`` fixture; ``store`` builds on it).
from tests.integration.test_eviction import (  # noqa: F401
    test_chain_tail_is_evicted_before_head,
    test_held_lease_is_never_evicted,
)
from tests.integration.test_faults import (  # noqa: F401
    test_daemon_sigkill_turns_blocks_into_misses,
    test_flipped_byte_is_a_miss_for_the_rest_of_the_chain,
    test_meta_restart_rebuilds_index_from_daemon,
    test_writer_killed_between_start_and_commit,
)
from tests.integration.test_roundtrip import (  # noqa: F401
    KS,
    blocks,
    test_dedup_skips_stored_and_counts,
    test_leading_run_and_partial_prefix,
    test_pin_and_unpin,
    test_put_get_roundtrip_bytes_identical,
    test_written_one_way_read_the_other,
)
from tests.integration.test_ssd_moves import (  # noqa: F401
    test_gets_racing_demotion_and_promotion_always_serve_every_block,
)
from tests.integration.test_ssd_tier import (  # noqa: F401
    test_demote_under_pressure_then_promote_on_hit_bytes_identical,
    test_flipped_byte_on_ssd_is_a_miss_and_the_replica_is_dropped,
    test_sigkill_during_write_burst_then_restart_serves_committed_blocks,
)

COMPACT = ("meta.index=compact",)  # with the default cache policy, adaptive


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, meta_sets=COMPACT)
    try:
        yield c
    finally:
        c.close()


def test_a_compact_index_with_an_unknown_cache_policy_is_refused_at_start(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "meta", "--listen", "127.0.0.1:0",
         "--set", "meta.index=compact", "--set", "meta.cache_policy=lfu"],
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
        assert "while the adaptive cache policy" in r.read().decode()  # the compact index's policy


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
