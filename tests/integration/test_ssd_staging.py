"""SSD reads through shared memory for a client on the daemon's host (kvstore.daemon.staging),
with real processes: the bytes are right, they came staged (the daemon's counters say so), a
staging slice too small for a request streams the rest, other hosts and forced TCP stream, and
it all holds after a daemon restart."""

from __future__ import annotations

import urllib.request

import numpy as np
from conftest import wait_until

from kvstore import KeySpace, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig

KS = KeySpace(ModelFingerprint("ssd-staging", "bf16", 2, 2, 64))
SIZE = 256 << 10
DAEMON = ["daemon.ssd_bytes=64MiB", "daemon.metrics_port=0"]


def content(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, SIZE, dtype=np.uint8)


def staged(port: int) -> float:
    """Blocks the daemon handed out through its staging region, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvstore_daemon_blocks_total{") and 'transport="staged"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def read(meta: str, keys: list[bytes], **cfg) -> int:  # noqa: ANN003
    with SyncKVStoreClient(meta, ClientConfig(location_cache=0, **cfg)) as c:
        out = [np.empty(SIZE, np.uint8) for _ in keys]
        n = c.get_into(keys, out)
        for k, o in zip(keys[:n], out[:n]):
            assert np.array_equal(o, content(k)), "wrong bytes served"
        return n


def on_ssd(meta: str) -> int:
    with SyncKVStoreClient(meta) as c:
        return {s.tier: s.blocks for s in c.stats().segments}.get(2, 0)


def test_same_host_ssd_reads_come_staged_and_survive_a_daemon_restart(cluster):
    cluster.start_meta()
    d = cluster.start_daemon(*DAEMON, dram="1MiB", name="staging")
    keys = KS.block_keys(np.arange(16 * 24))
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(keys, [content(k) for k in keys]).stored == 24
    assert on_ssd(cluster.meta_addr) >= 20  # 1 MiB of DRAM: nearly all of it went to SSD
    port = d.info["metrics_port"]
    before = staged(port)
    assert read(cluster.meta_addr, keys) == 24
    assert staged(port) - before >= 12  # SSD blocks came through shared memory (as many as a slice holds)
    # Forced TCP (as from another host): streamed, never staged.
    before = staged(port)
    assert read(cluster.meta_addr, keys, transport="tcp") == 24
    assert staged(port) == before
    # A restarted daemon (SIGKILL: its staging region is made anew) stages again.
    d.kill()
    d = cluster.start_daemon(*DAEMON, dram="1MiB", name="staging")
    wait_until(lambda: on_ssd(cluster.meta_addr) >= 16, timeout=30)
    port = d.info["metrics_port"]
    assert read(cluster.meta_addr, keys) == 24
    assert staged(port) >= 12


def test_a_staging_slice_too_small_for_a_request_streams_the_rest(cluster):
    cluster.start_meta()
    d = cluster.start_daemon(
        *DAEMON, "daemon.staging_bytes=600KiB", "daemon.staging_slices=1", dram="1MiB", name="small"
    )
    keys = KS.block_keys(np.arange(16 * 12, 16 * 24))
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(keys, [content(k) for k in keys]).stored == 12
    port = d.info["metrics_port"]
    assert read(cluster.meta_addr, keys, io_threads=1) == 12  # one slice holds 2 blocks per request
    assert 1 <= staged(port) <= 4


def test_compressed_ssd_blocks_come_staged_whole(cluster):
    cluster.start_meta()
    d = cluster.start_daemon(*DAEMON, dram="1MiB", name="lz4")
    keys = KS.block_keys(np.arange(16 * 30, 16 * 40))
    # Compressible (a repeated 4 KiB pattern): stored lz4 on SSD, inflated in the staging slot.
    blocks = {k: np.tile(content(k)[:4096], SIZE // 4096) for k in keys}
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(keys, list(blocks.values())).stored == 10
        assert {s.tier: s.used_bytes for s in c.stats().segments}.get(2, 1 << 30) < 8 * SIZE  # compressed
    with SyncKVStoreClient(cluster.meta_addr, ClientConfig(location_cache=0)) as c:
        out = [np.empty(SIZE, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == 10
        assert all(np.array_equal(o, blocks[k]) for o, k in zip(out, keys))
    assert staged(d.info["metrics_port"]) >= 5  # those on SSD (1 MiB of DRAM holds a few)


def test_a_client_maps_the_staging_region_anew_after_a_clean_daemon_restart(cluster):
    """A clean stop removes the staging region; the restarted daemon makes a new one at the
    same path. A client that mapped the old one must not copy from it."""
    cluster.start_meta()
    d = cluster.start_daemon(*DAEMON, dram="1MiB", name="again")
    keys = KS.block_keys(np.arange(16 * 40, 16 * 64))
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(keys, [content(k) for k in keys]).stored == 24
    first, second = keys[:12], keys[12:]
    with SyncKVStoreClient(cluster.meta_addr, ClientConfig(location_cache=0)) as c:
        out = [np.empty(SIZE, np.uint8) for _ in first]
        assert c.get_into(first, out) == 12  # maps the staging region
        assert all(np.array_equal(o, content(k)) for o, k in zip(out, first))
        d.stop()  # SIGTERM: drains, stops, removes its staging region
        d = cluster.start_daemon(*DAEMON, dram="1MiB", name="again")
        wait_until(lambda: on_ssd(cluster.meta_addr) >= 16, timeout=30)
        # Other blocks now: the old region still holds the first ones at the same offsets.
        out = [np.zeros(SIZE, np.uint8) for _ in second]
        n = c.get_into(second, out)
        assert n == 12 and all(np.array_equal(o, content(k)) for o, k in zip(out, second))
        assert staged(d.info["metrics_port"]) >= 8  # through the new region


class _Recording:
    """A staging region whose reads are recorded: (start, stop) of every block copied from it."""

    def __init__(self, region, spans: list) -> None:  # noqa: ANN001
        self.size = region.size
        self.array = self
        self._a = region.array
        self._spans = spans

    def __getitem__(self, sl: slice) -> np.ndarray:
        self._spans.append((sl.start, sl.stop))
        return self._a[sl]


def test_two_staged_requests_in_flight_never_share_staging_bytes(cluster, monkeypatch):
    """A client keeps two staged requests in flight on a connection: the daemon must stage the
    second where the first's blocks are not, since the client is still copying them."""
    from kvstore.transport.tcp import TcpTransport

    cluster.start_meta()
    d = cluster.start_daemon(
        *DAEMON, "daemon.staging_bytes=1200KiB", "daemon.staging_slices=1", dram="1MiB", name="halves"
    )
    warm = KS.block_keys(np.arange(16 * 100, 16 * 104))
    keys = KS.block_keys(np.arange(16 * 104, 16 * 128))
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(warm + keys, [content(k) for k in warm + keys]).stored == 28
    answers: list[list] = []
    orig = TcpTransport._recv_read

    def recording(s, addr, items, dests, msg, staging):  # noqa: ANN001, ANN202
        answers.append([])
        spans = answers[-1]
        wrapped = (lambda *a: _Recording(staging(*a), spans)) if staging is not None else None
        return orig(s, addr, items, dests, msg, wrapped)

    monkeypatch.setattr(TcpTransport, "_recv_read", staticmethod(recording))
    with SyncKVStoreClient(cluster.meta_addr, ClientConfig(location_cache=0, io_threads=1)) as c:
        out = [np.empty(SIZE, np.uint8) for _ in warm]
        assert c.get_into(warm, out) == 4  # learns how much one request may stage (2 blocks here)
        answers.clear()
        out = [np.empty(SIZE, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == 24
        assert all(np.array_equal(o, content(k)) for o, k in zip(out, keys)), "wrong bytes served"
    staged_answers = [a for a in answers if a]
    assert len(staged_answers) >= 8, answers  # 24 blocks, 2 staged per request, 1 MiB of DRAM aside
    for first, second in zip(staged_answers, staged_answers[1:]):
        for a0, a1 in first:
            for b0, b1 in second:
                assert a1 <= b0 or b1 <= a0, f"consecutive answers staged over each other: {first} {second}"
    assert staged(d.info["metrics_port"]) >= 16


def test_a_bad_block_in_a_pipelined_staged_read_ends_the_prefix_there(cluster):
    """Several staged requests in flight; a flipped byte on SSD in one of the later ones: the
    blocks before it are served right, it and the rest are misses, and it is reported."""
    from test_faults import locations

    from kvstore.extent import HEADER_SIZE

    cluster.start_meta()
    cluster.start_daemon(*DAEMON, "daemon.staging_bytes=1200KiB", "daemon.staging_slices=1", dram="1MiB", name="flip")
    warm = KS.block_keys(np.arange(16 * 200, 16 * 204))
    keys = KS.block_keys(np.arange(16 * 204, 16 * 228))
    with SyncKVStoreClient(cluster.meta_addr) as c:
        assert c.put(warm + keys, [content(k) for k in warm + keys]).stored == 28
    locs = locations(cluster.meta_addr, keys)
    bad = next(i for i in range(13, 24) if locs[i].segment.tier == 2)
    data = cluster.tmp / "daemon-flip" / "ssd" / f"ssd-{locs[bad].segment.segment_id}.data"
    with open(data, "r+b") as f:
        f.seek(locs[bad].offset + HEADER_SIZE + 999)
        b = f.read(1)
        f.seek(locs[bad].offset + HEADER_SIZE + 999)
        f.write(bytes([b[0] ^ 0x01]))
    with SyncKVStoreClient(cluster.meta_addr, ClientConfig(location_cache=0, io_threads=1)) as c:
        out = [np.empty(SIZE, np.uint8) for _ in warm]
        assert c.get_into(warm, out) == 4
        out = [np.empty(SIZE, np.uint8) for _ in keys]
        assert c.get_into(keys, out) == bad
        assert all(np.array_equal(o, content(k)) for o, k in zip(out[:bad], keys[:bad]))
        wait_until(lambda: c.stats().counters["corrupt_reported"] == 1)
        assert c.lookup(keys) == bad
