"""A request head sizes nothing before its entries arrive: peers that each send only a head
announcing the most entries a frame may carry make a real DataPort (on loopback) hold about a
receive chunk each, not the announced entries' bytes, while a well-behaved client is served."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time
import tracemalloc

import numpy as np
from conftest import recv_all

from kvstore.daemon.arena import ShmArena
from kvstore.daemon.dataport import DataPort
from kvstore.extent import HEADER_SIZE, Sealer, checksum
from kvstore.transport.frames import (
    ENTRY,
    MAGIC,
    MAX_ENTRIES,
    REQ_HEAD,
    RESP_HEAD,
    VERSION,
    EntryStatus,
    FrameStatus,
    Op,
)

SEG = 1
PEERS = 50
MB = 1 << 20


def _unread(s: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def _wait_taken(dp: DataPort, n: int) -> None:
    """Until the data port serves ``n`` connections and has taken every byte sent on them."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with dp._lock:
            conns = list(dp._conns)
        if len(conns) == n and not any(_unread(c) for c in conns):
            return
        time.sleep(0.01)
    raise AssertionError(f"the data port did not take every byte its {n} peers sent")


def _stop(dp: DataPort, peers: list[socket.socket]) -> None:
    """Closes the peers and stops the port, waiting for its threads to let go of the segments."""
    for s in peers:
        s.close()
    dp.stop()
    deadline = time.monotonic() + 10
    while dp.connections and time.monotonic() < deadline:
        time.sleep(0.01)


def test_heads_announcing_many_entries_hold_no_memory_for_them(tmp_path):
    sealer = Sealer(b"s" * 32)
    arena = ShmArena(tmp_path / "arena", 4 * MB, create=True)
    data = np.random.default_rng(2).integers(0, 256, 10_000, dtype=np.uint8)
    arena.array[HEADER_SIZE : HEADER_SIZE + data.size] = data
    assert arena.commit(sealer, 0, b"b" * 16, data.size, checksum(data), 5)
    dp = DataPort("127.0.0.1", 0, lambda: {SEG: arena}, sealer)
    dp.start()
    peers: list[socket.socket] = []
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(PEERS):
            s = socket.create_connection(("127.0.0.1", dp.port), timeout=10)
            s.sendall(REQ_HEAD.pack(MAGIC, VERSION, Op.READ, 0, 1, MAX_ENTRIES))
            peers.append(s)
        _wait_taken(dp, PEERS)  # every head taken off its socket: each connection waits for its entries

        # A well-behaved client meanwhile.
        with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as good:
            e = ENTRY.pack(b"b" * 16, SEG, 0, 0, data.size, 0, 5, bytes(16))
            good.sendall(REQ_HEAD.pack(MAGIC, VERSION, Op.READ, 0, 9, 1) + e)
            magic, status, _op, _f, rid, count, msg_len = RESP_HEAD.unpack(recv_all(good, RESP_HEAD.size))
            assert (magic, status, rid, count, msg_len) == (MAGIC, FrameStatus.OK, 9, 1, 0)
            assert recv_all(good, 1)[0] == EntryStatus.OK
            assert recv_all(good, data.size) == data.tobytes()

        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        _stop(dp, peers)
        arena.close()
    announced = PEERS * MAX_ENTRIES * ENTRY.size  # 236 MB
    assert held < announced // 8, (held, announced)


def test_an_ssd_write_holds_memory_for_what_arrived_not_for_what_it_announced(tmp_path):
    """Without tickets an entry's length is the peer's word alone: peers that each announce a
    64 MiB SSD block and send 1 MiB of it make the data port hold a staging buffer of about
    what arrived each, while a well-behaved write of a block larger than the least staging
    buffer lands whole."""
    from kvstore.daemon.ssd import SsdSegment

    ssd_id, peers_n, big = 2, 4, 64 * MB
    ssd = SsdSegment(tmp_path / "ssd", ssd_id, 96 * MB, direct_io=False)
    dp = DataPort("127.0.0.1", 0, lambda: {ssd_id: ssd}, Sealer(b"s" * 32))
    dp.start()
    peers: list[socket.socket] = []
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(peers_n):
            s = socket.create_connection(("127.0.0.1", dp.port), timeout=10)
            e = ENTRY.pack(bytes([i]) * 16, ssd_id, 0, 0, big, 0, 1 + i, bytes(16))
            s.sendall(REQ_HEAD.pack(MAGIC, VERSION, Op.WRITE, 0, 1, 1) + e + bytes(MB))
            peers.append(s)
        _wait_taken(dp, peers_n)  # every peer's megabyte taken off its socket
        held = tracemalloc.get_traced_memory()[0] - base
        assert held < peers_n * big // 4, (held, peers_n * big)

        data = np.random.default_rng(5).integers(0, 256, 9 * MB + 5, dtype=np.uint8)
        key, off, gen = b"w" * 16, 32 * MB, 77
        with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as good:
            e = ENTRY.pack(key, ssd_id, 0, off, data.size, checksum(data), gen, bytes(16))
            good.sendall(REQ_HEAD.pack(MAGIC, VERSION, Op.WRITE, 0, 3, 1) + e)
            good.sendall(memoryview(data))
            magic, status, _op, _f, rid, count, msg_len = RESP_HEAD.unpack(recv_all(good, RESP_HEAD.size))
            assert (magic, status, rid, count, msg_len) == (MAGIC, FrameStatus.OK, 3, 1, 0)
            assert recv_all(good, 1)[0] == EntryStatus.OK
        assert ssd.commit(off, key, gen) is not None
        st, out = ssd.read(off, key, data.size, gen=gen)
        assert st.ok and np.array_equal(out, data)
    finally:
        tracemalloc.stop()
        _stop(dp, peers)
        ssd.close()
