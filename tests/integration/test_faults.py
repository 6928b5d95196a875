"""The failure contract with real processes: crashed writers, killed daemons, a restarted
metadata service, corrupted bytes, and many concurrent clients."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import REPO, flip_byte, locations, wait_until

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.extent import HEADER_SIZE
from kvstore.meta.records import WRITE_TICKET_GRACE_S

KS = KeySpace(ModelFingerprint("fault-model", "bf16", 2, 2, 64))


def chain(n: int, start: int = 0) -> list[bytes]:
    return KS.block_keys(np.arange(start, start + 16 * n))


def data(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


WRITER = textwrap.dedent(
    """
    import sys, numpy as np, grpc
    from kvstore.v1 import meta_pb2, meta_pb2_grpc
    from kvstore.wire import pack, U64, locations_from_pb
    from kvstore.daemon.arena import ShmArena
    from kvstore.extent import HEADER_SIZE
    meta, keys_hex = sys.argv[1], sys.argv[2]
    keys = bytes.fromhex(keys_hex)
    n = len(keys) // 16
    stub = meta_pb2_grpc.MetaServiceStub(grpc.insecure_channel(meta))
    resp = stub.PutStart(meta_pb2.PutStartRequest(keys=keys, sizes=pack([65536] * n, U64)))
    places = locations_from_pb(resp.placements, n)
    seg = places[0].daemon.segments[0]
    arena = ShmArena(seg.shm_path, seg.capacity_bytes)
    for p in places:  # half of each payload, no header: then we die
        arena.array[p.offset + HEADER_SIZE : p.offset + HEADER_SIZE + 32768] = 7
    print("RESERVED", flush=True)
    import time; time.sleep(600)
    """
)


def test_writer_killed_between_start_and_commit(cluster):
    # A long daemon lease, so that skewing the clock past the put deadline expires only the put.
    cluster.start_meta("meta.daemon_ttl_s=600")
    cluster.start_daemon()
    store = cluster
    keys = chain(4)
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER, store.meta_addr, b"".join(keys).hex()], stdout=subprocess.PIPE, cwd=REPO
    )
    try:
        assert p.stdout.readline().strip() == b"RESERVED"
        with SyncKVStoreClient(store.meta_addr) as c:
            s = c.stats()
            assert s.pending_puts == 1 and s.segments[0].used_bytes > 0
            p.kill()
            p.wait()
            # Nothing half-written is visible, and another writer is told "in flight", not given it.
            assert c.lookup(keys) == 0
            assert c.exists(keys) == [False] * 4
            assert c.put(keys, data(4, 65536)).skipped == 4
            out = [np.zeros(65536, np.uint8) for _ in keys]
            assert c.get_into(keys, out) == 0
            # Past the put deadline (time injected), the reservation is reclaimed.
            c.advance_clock(31)
            wait_until(lambda: c.stats().pending_puts == 0)
            s = c.stats()
            assert s.keys == 0 and s.counters["expired_puts"] == 1
            # Its extents go back to the allocator once its write tickets can no longer be used.
            assert s.segments[0].used_bytes > 0
            c.advance_clock(WRITE_TICKET_GRACE_S)
            wait_until(lambda: c.stats().segments[0].used_bytes == 0)
            # ... and the keys can be written and read again, whole.
            d = data(4, 65536, seed=5)
            assert c.put(keys, d).stored == 4
            assert c.get_into(keys, out) == 4
            assert all(np.array_equal(a, b) for a, b in zip(out, d))
    finally:
        p.kill()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_daemon_sigkill_turns_blocks_into_misses(cluster, transport):
    cluster.start_meta()
    d = cluster.start_daemon()
    keys = chain(5)
    payload = data(5, 50000)
    with SyncKVStoreClient(cluster.meta_addr, ClientConfig(transport=transport)) as c:
        c.put(keys, payload)
        d.kill()
        # Right after the kill: never an error, never wrong bytes (shm outlives the process).
        out = [np.zeros(50000, np.uint8) for _ in keys]
        n = c.get_into(keys, out)
        assert 0 <= n <= 5
        assert all(np.array_equal(out[i], payload[i]) for i in range(n))
        if transport == "tcp":
            assert n == 0
        # Past the liveness deadline its replicas leave the index.
        c.advance_clock(5)
        wait_until(lambda: c.lookup(keys) == 0)
        assert c.get_into(keys, out) == 0
        s = c.stats()
        assert s.counters["daemons_lost"] == 1 and s.keys == 0
        # Writers go elsewhere: with no daemon left, a put is refused as retryable (UNAVAILABLE:
        # a daemon may come back), never as out of space.
        from kvstore.errors import Unavailable

        with pytest.raises(Unavailable, match="no live daemon"):
            c.put(chain(1, start=999), data(1, 100))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_meta_restart_rebuilds_index_from_daemon(cluster):
    listen = f"127.0.0.1:{_free_port()}"
    meta = cluster.start_meta(listen=listen)
    cluster.start_daemon()
    keys = chain(6)
    payload = data(6, 70000, seed=9)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        c.put(keys, payload)
        c.remove([keys[5]])  # removed before the restart: must stay removed
        assert c.lookup(keys) == 5
    # Let the removal's invalidation reach the daemon (piggybacked on heartbeats).
    wait_until(lambda: _header_cleared(cluster, keys[5]))
    meta.kill()
    cluster.procs.remove(meta)
    cluster.start_meta(listen=listen)
    with SyncKVStoreClient(cluster.meta_addr) as c:
        wait_until(lambda: c.lookup(keys) == 5)
        out = [np.zeros(70000, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == 5
        assert all(np.array_equal(a, b) for a, b in zip(out[:5], payload[:5]))
        s = c.stats()
        assert s.keys == 5 and s.segments[0].blocks == 5
        # New writes go to free space, never over the rebuilt blocks.
        more = chain(3, start=5000)
        more_data = data(3, 70000, seed=10)
        assert c.put(more, more_data).stored == 3
        assert c.get_into(keys, out) == 5
        assert all(np.array_equal(a, b) for a, b in zip(out[:5], payload[:5]))


def _header_cleared(cluster, key: bytes) -> bool:
    from kvstore.extent import MAGIC

    path = cluster.shm_paths[0]
    raw = open(path, "rb").read()
    i = raw.find(key)
    # The key appears in its header at offset +8; a cleared header has lost its magic.
    while i != -1:
        if raw[i - 8 : i - 4] == MAGIC:
            return False
        i = raw.find(key, i + 1)
    return True


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_flipped_byte_is_a_miss_for_the_rest_of_the_chain(store, transport):
    keys = chain(5, start=77)
    payload = data(5, 40000, seed=2)
    with SyncKVStoreClient(store.meta_addr, ClientConfig(transport=transport)) as c:
        c.put(keys, payload)
        loc = locations(store.meta_addr, keys)[2]
        flip_byte(store.shm_paths[0], loc.offset + HEADER_SIZE + 1234)
        out = [np.zeros(40000, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == 2
        assert all(np.array_equal(out[i], payload[i]) for i in range(2))
        # The bad replica is dropped: the chain now ends before it, for everyone.
        wait_until(lambda: c.lookup(keys) == 2)
        assert c.stats().counters["corrupt_reported"] == 1
        assert c.exists(keys) == [True, True, False, True, True]


MIXED = textwrap.dedent(
    """
    import json, sys, numpy as np, xxhash
    from kvstore import SyncKVStoreClient, KeySpace, ModelFingerprint
    from kvstore.config import ClientConfig
    meta, worker, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ks = KeySpace(ModelFingerprint("mixed", "bf16", 2, 2, 64))
    rng = np.random.default_rng(worker)
    SIZE = 32768
    def content(key):  # every writer derives a block's bytes from its key alone
        return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, SIZE, dtype=np.uint8)
    stats = dict(puts=0, gets=0, loaded=0, mismatches=0)
    with SyncKVStoreClient(meta, ClientConfig(transport=transport)) as c:
        for step in range(60):
            conv = int(rng.integers(0, 40))
            n = int(rng.integers(1, 9))
            keys = ks.block_keys(np.arange(conv * 1000, conv * 1000 + 16 * n))
            if rng.random() < 0.5:
                c.put(keys, [content(k) for k in keys]); stats["puts"] += 1
            else:
                out = [np.empty(SIZE, np.uint8) for _ in keys]
                got = c.get_into(keys, out); stats["gets"] += 1; stats["loaded"] += got
                stats["mismatches"] += sum(int(not np.array_equal(out[i], content(keys[i]))) for i in range(got))
    print(json.dumps(stats))
    """
)


def test_eight_client_processes_mixed_puts_and_gets_see_no_mismatch(cluster):
    cluster.start_meta()
    cluster.start_daemon(dram="4MiB")  # small: eviction runs during the test too
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MIXED, cluster.meta_addr, str(i), "tcp" if i % 2 else "shm"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
        )
        for i in range(8)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
        results.append(json.loads(out))
    assert sum(r["mismatches"] for r in results) == 0
    assert sum(r["loaded"] for r in results) > 0
    with SyncKVStoreClient(cluster.meta_addr) as c:
        s = c.stats()
        assert s.counters["evictions"] > 0
        assert s.active_leases == 0


def test_a_commit_whose_caller_gives_up_is_still_ended_when_the_daemon_answers(cluster):
    """PutCommit's caller times out while the service waits for the daemon's Commit (the daemon
    is stopped): the put has left the reservation table, and it is ended once the daemon answers,
    so that its key does not stay "being written" for as long as the daemon lives."""
    import os
    import signal

    import grpc

    from kvstore.v1 import meta_pb2, meta_pb2_grpc
    from kvstore.wire import U8, U64, pack, unpack

    cluster.start_meta("meta.daemon_ttl_s=30", "meta.heartbeat_interval_s=0.1")
    d = cluster.start_daemon(dram="8MiB", name="slow")
    stub = meta_pb2_grpc.MetaServiceStub(grpc.insecure_channel(cluster.meta_addr))
    k = chain(1, 900)[0]
    r = stub.PutStart(meta_pb2.PutStartRequest(keys=k, sizes=pack([1000], U64)), timeout=10)
    os.kill(d.p.pid, signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as gave_up:
            stub.PutCommit(meta_pb2.PutCommitRequest(put_id=r.put_id, checksums=pack([1], U64)), timeout=1.0)
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        os.kill(d.p.pid, signal.SIGCONT)

    def put_again() -> list[int]:
        again = stub.PutStart(meta_pb2.PutStartRequest(keys=k, sizes=pack([1000], U64)), timeout=10)
        if again.put_id and len(again.placements.rows):
            stub.PutAbort(meta_pb2.PutAbortRequest(put_id=again.put_id), timeout=10)
        return unpack(again.status, U8, "status")

    # Ended when the daemon answered (committed, or refused and dropped): the key is stored
    # (SKIP_EXISTS) or free (ALLOCATED), not "being written" (SKIP_INFLIGHT) for good.
    wait_until(lambda: put_again() in ([0], [1]), timeout=20)
    assert stub.Stats(meta_pb2.StatsRequest(), timeout=10).pending_puts == 0


def test_a_put_whose_commit_gets_no_answer_gives_its_reservation_back(cluster):
    """The service stops answering (paused) between a put's PutStart and its PutCommit, and the
    client's commit times out: the client gives the reservation back, so that once the service
    runs again the keys are not "being written" until the put's deadline (60 s here), and a
    retry stores them instead of being told they are skipped."""
    import os
    import signal

    from kvstore.errors import Timeout

    meta = cluster.start_meta()
    cluster.start_daemon(dram="8MiB")
    keys = chain(3, 950)
    payloads = data(3, 4096)
    cfg = ClientConfig(rpc_timeout_s=1.0, put_timeout_s=60.0, retries=0)
    with SyncKVStoreClient(cluster.meta_addr, cfg) as c:
        stub = c._client._stub
        real = stub.PutCommit

        def paused_commit(request, **kw):  # noqa: ANN001, ANN003, ANN202
            os.kill(meta.p.pid, signal.SIGSTOP)
            return real(request, **kw)

        stub.PutCommit = paused_commit
        try:
            with pytest.raises(Timeout):
                c.put(keys, payloads)
        finally:
            os.kill(meta.p.pid, signal.SIGCONT)
            stub.PutCommit = real
        wait_until(lambda: c.stats().pending_puts == 0, timeout=15)
        res = c.put(keys, payloads)
        assert (res.stored, res.skipped) == (3, 0)
        out = [np.zeros(4096, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == 3
        assert all(np.array_equal(a, b) for a, b in zip(out, payloads))
