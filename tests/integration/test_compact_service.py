"""The metadata service on the compact index (``meta.index=compact``), with real processes: the
round trips, eviction order, faults and restarts that the service's own tests run on the object
index, run again here on a service whose every block is a row of the block table
(kvstore.meta.compact), plus what differs: no tier moves, a configuration that asks for a
policy the compact index does not have is refused, and the service's state reads the same."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, Cluster, flip_byte, locations, wait_until

from kvstore import SyncKVStoreClient
from kvstore.extent import HEADER_SIZE

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

COMPACT = ("meta.index=compact", "meta.cache_policy=lru")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, meta_sets=COMPACT)
    try:
        yield c
    finally:
        c.close()


def test_a_compact_index_with_another_cache_policy_is_refused_at_start(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "meta", "--listen", "127.0.0.1:0", "--set", "meta.index=compact"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert "meta.index=compact" in out.stderr and "meta.cache_policy=lru" in out.stderr


def test_blocks_stay_on_the_tier_they_were_written_to_and_read_back_exact(cluster: Cluster) -> None:
    """DRAM fills first, then SSD; no block moves between them (the compact index plans no moves),
    and every block reads back as written, from either tier."""
    cluster.start_meta()
    cluster.start_daemon("daemon.ssd_bytes=64MiB", dram="4MiB", name="tiers")
    size = 256 << 10
    keys = KS.block_keys(list(range(40 * 16)))[:40]  # 10 MiB: more than DRAM holds
    data = blocks(len(keys), size, seed=7)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(keys, data).stored == len(keys)
        where = c.lookup_tiers(keys).tiers
        assert set(where) == {1, 2} and where.count(1) <= 15  # DRAM (4 MiB) full, the rest on SSD
        out = [np.zeros(size, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == len(keys)
        for i, (a, b) in enumerate(zip(out, data)):
            assert np.array_equal(a, b), f"block {i} came back with other bytes"
        assert c.lookup_tiers(keys).tiers == where  # nothing was promoted or demoted
        st = c.stats()
        assert st.keys == len(keys)
        assert st.counters["demoted"] == st.counters["promoted"] == 0
        assert st.counters["put_ssd_keys"] == where.count(2)
        # A damaged byte of a block on SSD: a miss from there on, reported, and the block gone.
        i = where.index(2, 20)
        loc = locations(cluster.meta_addr, keys)[i]
        assert loc.segment.tier == 2
        flip_byte(cluster.tmp / "daemon-tiers" / "ssd" / "ssd-2.data", loc.offset + HEADER_SIZE + 100)
        out = [np.zeros(size, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == i
        assert all(np.array_equal(out[j], data[j]) for j in range(i))
        wait_until(lambda: c.lookup(keys) == i)
        assert c.stats().counters["corrupt_reported"] == 1


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
