"""A sharded cluster on loopback (kvstore.cluster.testbed): Redis, 2 metadata shards with a
primary and a standby each, 2 daemons, all separate processes. Reads and writes spread over the
shards; a killed primary's standby takes over with the daemons' blocks; `kvstore stat` shows the
shards; a daemon refuses control calls of an older epoch."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from kvstore.client import SyncKVStoreClient
from kvstore.cluster.slots import SlotMap
from kvstore.cluster.testbed import Testbed
from kvstore.v1 import daemon_pb2, daemon_pb2_grpc

pytestmark = pytest.mark.timeout(180)

BLOCK = 8192


@pytest.fixture(scope="module")
def tb(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    with Testbed(tmp_path_factory.mktemp("cluster"), sets=("meta.max_block_bytes=1MiB",)) as t:
        t.start_redis()
        t.start_shards(2)
        t.start_daemon(0, name="da")
        t.start_daemon(0, name="db")
        yield t


def _chains(rng, n: int, length: int = 6):
    return [
        ([rng.bytes(16) for _ in range(length)], [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(length)])
        for _ in range(n)
    ]


def _read(c, keys, bufs) -> int:
    out = [np.zeros(BLOCK, dtype=np.uint8) for _ in keys]
    n = c.get_into(keys, out)
    for a, b in zip(out[:n], bufs[:n]):
        assert (a == b).all(), "wrong bytes returned"
    return n


def test_blocks_spread_over_shards_and_read_back(tb):
    rng = np.random.default_rng(0)
    chains = _chains(rng, 20)
    smap = SlotMap.even(2)
    with SyncKVStoreClient(config=tb.client_config()) as c:
        for keys, bufs in chains:
            assert c.put(keys, bufs).stored == len(keys)
        owners = {smap.shard_of(k) for keys, _ in chains for k in keys}
        assert owners == {0, 1}
        for keys, bufs in chains:
            assert c.lookup(keys) == len(keys)
            assert _read(c, keys, bufs) == len(keys)
        # The leading hit count is the first miss over both shards.
        keys, _ = chains[0]
        assert c.remove([keys[3]]) == 1
        assert c.lookup(keys) == 3
        assert c.exists(keys) == [True, True, True, False, True, True]
        assert c.put(keys[:3], chains[0][1][:3]).skipped == 3  # dedup, per shard
        st = c.stats()
        assert st.keys == 20 * 6 - 1
        assert {d.info.daemon_id for d in st.daemons} == {"da", "db"}
        state = c.cluster_state()
        assert [s["shard"] for s in state["shards"]] == [0, 1]
        assert all(s["epoch"] > 0 and s["daemons"] == 2 for s in state["shards"])
        assert sum(s["keys"] for s in state["shards"]) == st.keys
        # Every process is a member in Redis: the shards' processes and the daemons.
        roles = {(m["node"], m["role"]) for m in state["members"]}
        assert {("da", "daemon"), ("db", "daemon")} <= roles
        assert sum(1 for _n, r in roles if r == "leader") == 2 and sum(1 for _n, r in roles if r == "standby") == 2
    # A fresh client (no known locations) reads through the leases of both shards.
    with SyncKVStoreClient(config=tb.client_config(location_cache=0)) as c:
        for keys, bufs in chains[1:]:
            assert _read(c, keys, bufs) == len(keys)


def test_kvstore_stat_shows_shards_leaders_epochs_and_members(tb):
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "stat", "--redis", tb.redis_url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    leaders = tb.leaders()
    for lead in leaders:
        assert lead.addr in out.stdout and str(lead.epoch) in out.stdout
    assert "standby" in out.stdout and "leader" in out.stdout
    assert "da" in out.stdout and "db" in out.stdout


def test_killed_primary_is_replaced_and_loses_nothing(tb):
    rng = np.random.default_rng(1)
    chains = _chains(rng, 12)
    with SyncKVStoreClient(config=tb.client_config(location_cache=0)) as c:
        for keys, bufs in chains:
            assert c.put(keys, bufs).stored == len(keys)
        k, r = tb.leader_process(0)
        old = tb.leaders()[0]
        tb.shards[(k, r)].kill()
        t0 = time.monotonic()
        # Served again once every daemon has registered with the new leader (each brings its
        # own blocks back: until then some chains are misses, never errors).
        while any(c.lookup(keys) < len(keys) for keys, _ in chains):
            assert time.monotonic() - t0 < 20, "lookups not served again"
            time.sleep(0.05)
        new = tb.leaders()[0]
        assert new.epoch > old.epoch and new.node != old.node
        for keys, bufs in chains:  # every committed block, from the daemons' inventories
            assert _read(c, keys, bufs) == len(keys)
        # Writes go on through the new leader.
        more = _chains(rng, 3)
        for keys, bufs in more:
            assert c.put(keys, bufs).stored == len(keys)
            assert _read(c, keys, bufs) == len(keys)
    tb.start_shard(k, r, 0)  # back, as a standby


def test_daemon_refuses_control_calls_of_another_epoch(tb):
    lead = tb.leaders()[1]
    with SyncKVStoreClient(config=tb.client_config()) as c:
        daemons = {d.info.daemon_id: d.info for d in c.stats().daemons}
    ch = grpc.insecure_channel(daemons["da"].control_addr)
    stub = daemon_pb2_grpc.DaemonControlStub(ch)
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.Invalidate(daemon_pb2.InvalidateRequest(shard=1, epoch=lead.epoch - 1), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "epoch" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Commit(daemon_pb2.CommitRequest(shard=9, epoch=lead.epoch), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The current leader's epoch passes (an empty invalidation changes nothing).
        assert stub.Invalidate(daemon_pb2.InvalidateRequest(shard=1, epoch=lead.epoch), timeout=5).cleared == 0
    finally:
        ch.close()


def test_concurrent_lookups_share_shard_calls_and_each_gets_its_own_answer(tb):
    import asyncio

    from kvstore.client import KVStoreClient

    rng = np.random.default_rng(2)
    chains = _chains(rng, 8, length=5)
    with SyncKVStoreClient(config=tb.client_config()) as c:
        for keys, bufs in chains:
            c.put(keys, bufs)
    # Each probe: a stored chain cut after j blocks, then unknown keys: its answer is j.
    probes = [(keys[:j] + [rng.bytes(16) for _ in range(3)], j) for keys, _ in chains for j in range(6)]

    async def go() -> list[int]:
        async with KVStoreClient(config=tb.client_config()) as c:
            got = await asyncio.gather(*(c.lookup(keys) for keys, _ in probes * 4))
            flags = await asyncio.gather(*(c.exists(keys) for keys, _ in probes))
            return list(got), [list(f) for f in flags]

    got, flags = asyncio.run(go())
    assert got == [j for _, j in probes * 4]
    assert flags == [[True] * j + [False] * 3 for _, j in probes]


def test_leases_and_reservations_on_other_shards_are_given_back(tb):
    rng = np.random.default_rng(3)
    smap = SlotMap.even(2)
    keys, bufs = _chains(rng, 1, length=8)[0]
    with SyncKVStoreClient(config=tb.client_config(location_cache=0)) as c:
        assert c.put(keys, bufs).stored == 8
        # The chain's head is missing: no block leads, so no shard may keep a lease.
        head = next(k for k in (rng.bytes(16) for _ in range(100)) if smap.shard_of(k) != smap.shard_of(keys[0]))
        out = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(9)]
        assert c.get_into([head, *keys], out) == 0
        # One block over meta.max_block_bytes: its shard refuses the put, the other shard's
        # reservations go back.
        big = [rng.bytes(16) for _ in range(6)]
        assert {smap.shard_of(k) for k in big} == {0, 1}
        from kvstore.errors import InvalidArgument

        with pytest.raises(InvalidArgument):
            c.put(big, [np.zeros(BLOCK, np.uint8)] * 5 + [np.zeros(2 << 20, np.uint8)])
        deadline = time.monotonic() + 10
        while True:
            st = c.stats()
            if st.active_leases == 0 and st.pending_puts == 0:
                break
            assert time.monotonic() < deadline, (st.active_leases, st.pending_puts)
            time.sleep(0.05)
        assert c.exists(big) == [False] * 6


def test_engine_holdings_span_shards_and_lookups_merge_them(tb):
    rng = np.random.default_rng(5)
    keys = [rng.bytes(16) for _ in range(64)]
    smap = SlotMap.even(2)
    assert len(smap.split(b"".join(keys))) == 2, "the keys should fall on both shards"
    with SyncKVStoreClient(config=tb.client_config()) as c:
        assert c.report_engine_blocks("w1", "http://w1", keys[:40], reset=True) == 40
        t = c.lookup_tiers(keys)
        assert t.device("w1") == 40 and t.stored == 0 and len(t.tiers) == 64
        assert c.report_engine_blocks("w1", "http://w1", removed=keys[10:11]) == 39
        assert c.lookup_tiers(keys).device("w1") == 10
        assert c.report_engine_blocks("w1", leave=True) == 0
        assert c.lookup_tiers(keys).engines == {}
