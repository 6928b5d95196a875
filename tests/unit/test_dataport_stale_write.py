"""A WRITE with a ticket that is still within its expiry, for an extent that since holds a newer
committed block (the first put was aborted or ran past its deadline, and a later put got the
extent), is refused and leaves that block alone: a real DataPort on loopback, a real DRAM arena
and a real SSD segment. The service's generations only increase, so a committed block of the
ticket's generation or a later one means the ticket is stale."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from conftest import recv_all

from kvstore import tickets
from kvstore.daemon.arena import ShmArena
from kvstore.daemon.dataport import DataPort
from kvstore.daemon.ssd import SsdSegment
from kvstore.extent import HEADER_SIZE, Sealer, checksum
from kvstore.transport.frames import ENTRY, MAGIC, REQ_HEAD, RESP_HEAD, VERSION, EntryStatus, FrameStatus, Op

DRAM, SSD = 1, 2
TICKET_KEY = b"k" * 32
OLD_KEY, NEW_KEY = b"o" * 16, b"n" * 16
OLD_GEN, NEW_GEN = 1_000, 2_000
MB = 1 << 20


@pytest.fixture
def port(tmp_path):
    sealer = Sealer(b"s" * 32)
    arena = ShmArena(tmp_path / "arena", 16 * MB, create=True)
    ssd = SsdSegment(tmp_path / "ssd", SSD, 16 * MB, direct_io=False)
    dp = DataPort("127.0.0.1", 0, lambda: {DRAM: arena, SSD: ssd}, sealer, ticket_key=TICKET_KEY)
    dp.start()
    try:
        yield dp, sealer, arena, ssd
    finally:
        dp.stop()
        deadline = time.monotonic() + 10
        while dp.connections and time.monotonic() < deadline:  # their threads let go of the arena
            time.sleep(0.01)
        arena.close()
        ssd.close()


def _entry(op: int, key: bytes, seg: int, off: int, length: int, csum: int, gen: int) -> bytes:
    expiry = int(time.time()) + 60
    mac = tickets.mac(TICKET_KEY, tickets.READ if op == Op.READ else tickets.WRITE, seg, off, length, gen, expiry, key)
    return ENTRY.pack(key, seg, expiry, off, length, csum, gen, mac)


def _write(s: socket.socket, key: bytes, seg: int, off: int, payload: np.ndarray, gen: int) -> int:
    """One WRITE of one entry; its status."""
    e = _entry(Op.WRITE, key, seg, off, payload.size, checksum(payload), gen)
    s.sendall(REQ_HEAD.pack(MAGIC, VERSION, Op.WRITE, 0, 1, 1) + e)
    s.sendall(memoryview(payload))
    magic, status, _op, _f, _rid, count, msg_len = RESP_HEAD.unpack(recv_all(s, RESP_HEAD.size))
    msg = recv_all(s, msg_len) if msg_len else b""
    assert (magic, status, count) == (MAGIC, FrameStatus.OK, 1), msg
    return recv_all(s, 1)[0]


def _read(s: socket.socket, key: bytes, seg: int, off: int, length: int, gen: int) -> tuple[int, bytes]:
    """One READ of one entry: its status and payload."""
    s.sendall(REQ_HEAD.pack(MAGIC, VERSION, Op.READ, 0, 2, 1) + _entry(Op.READ, key, seg, off, length, 0, gen))
    magic, status, _op, _f, _rid, count, msg_len = RESP_HEAD.unpack(recv_all(s, RESP_HEAD.size))
    msg = recv_all(s, msg_len) if msg_len else b""
    assert (magic, status, count) == (MAGIC, FrameStatus.OK, 1), msg
    st = recv_all(s, 1)[0]
    return st, recv_all(s, length) if st == EntryStatus.OK else b""


def _committed_dram(sealer: Sealer, arena: ShmArena, off: int, key: bytes, data: np.ndarray, gen: int) -> None:
    arena.array[off + HEADER_SIZE : off + HEADER_SIZE + data.size] = data
    assert arena.commit(sealer, off, key, data.size, checksum(data), gen)


# A payload under the staging buffer's least size, and one over it (drained in several pieces).
LENGTHS = [4096, 5 * MB + 3]


@pytest.mark.parametrize("stale_gen", [OLD_GEN, NEW_GEN], ids=["older_gen", "same_gen"])
@pytest.mark.parametrize("length", LENGTHS)
def test_stale_write_ticket_leaves_a_newer_dram_block_alone(port, length, stale_gen):
    dp, sealer, arena, _ssd = port
    off = 0
    newer = np.full(length, 7, np.uint8)
    _committed_dram(sealer, arena, off, NEW_KEY, newer, NEW_GEN)
    header = bytes(arena.view[off : off + HEADER_SIZE])
    junk = np.full(length, 0xEE, np.uint8)
    with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as s:
        assert _write(s, OLD_KEY, DRAM, off, junk, stale_gen) == EntryStatus.MISMATCH
        # The payload was drained: the same connection goes on, and the newer block is whole.
        assert bytes(arena.view[off : off + HEADER_SIZE]) == header
        h = sealer.parse(arena.view, off)
        assert h is not None and (h.key, h.gen, h.length) == (NEW_KEY, NEW_GEN, length)
        assert np.array_equal(arena.array[off + HEADER_SIZE : off + HEADER_SIZE + length], newer)
        st, got = _read(s, NEW_KEY, DRAM, off, length, NEW_GEN)
        assert st == EntryStatus.OK and got == newer.tobytes()


def test_write_ticket_of_a_later_put_still_lands_over_an_older_dram_block(port):
    dp, sealer, arena, _ssd = port
    off = 64 * 1024
    older = np.full(4096, 3, np.uint8)
    _committed_dram(sealer, arena, off, OLD_KEY, older, OLD_GEN)
    fresh = np.full(4096, 9, np.uint8)
    with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as s:
        assert _write(s, NEW_KEY, DRAM, off, fresh, NEW_GEN) == EntryStatus.OK
    assert sealer.parse(arena.view, off) is None  # cleared until the service commits the put
    assert np.array_equal(arena.array[off + HEADER_SIZE : off + HEADER_SIZE + fresh.size], fresh)


@pytest.mark.parametrize("stale_gen", [OLD_GEN, NEW_GEN], ids=["older_gen", "same_gen"])
@pytest.mark.parametrize("length", LENGTHS)
def test_stale_write_ticket_leaves_a_newer_ssd_block_alone(port, length, stale_gen):
    dp, _sealer, _arena, ssd = port
    off = 0
    newer = np.random.default_rng(1).integers(0, 256, length, dtype=np.uint8)
    ssd.write(off, NEW_KEY, newer, checksum(newer), NEW_GEN)
    assert ssd.commit(off, NEW_KEY, NEW_GEN) is not None
    junk = np.full(length, 0xEE, np.uint8)
    with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as s:
        assert _write(s, OLD_KEY, SSD, off, junk, stale_gen) == EntryStatus.MISMATCH
        assert ssd.committed_gen(off) == NEW_GEN
        st, out = ssd.read(off, NEW_KEY, length, gen=NEW_GEN)
        assert st.ok and np.array_equal(out, newer)
        st, got = _read(s, NEW_KEY, SSD, off, length, NEW_GEN)
        assert st == EntryStatus.OK and got == newer.tobytes()


def test_write_ticket_where_nothing_is_committed_on_ssd_lands(port):
    dp, _sealer, _arena, ssd = port
    off = 1 * MB
    assert ssd.committed_gen(off) is None
    data = np.full(4096, 5, np.uint8)
    with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as s:
        assert _write(s, NEW_KEY, SSD, off, data, NEW_GEN) == EntryStatus.OK
    assert ssd.commit(off, NEW_KEY, NEW_GEN) is not None
    st, out = ssd.read(off, NEW_KEY, data.size, gen=NEW_GEN)
    assert st.ok and np.array_equal(out, data)


def test_a_write_ticket_is_spent_once_its_block_is_committed(port):
    """A block written with a ticket and committed, then dropped (its header cleared, its bytes
    free for another block): the same ticket writes nothing more, there or anywhere, while a
    ticket whose block was never committed still writes (a retry of an unfinished put)."""
    dp, sealer, arena, _ssd = port
    off, data = 128 * 1024, np.full(4096, 4, np.uint8)
    with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as s:
        assert _write(s, OLD_KEY, DRAM, off, data, OLD_GEN) == EntryStatus.OK
        assert _write(s, OLD_KEY, DRAM, off, data, OLD_GEN) == EntryStatus.OK  # not committed yet
        assert arena.commit(sealer, off, OLD_KEY, data.size, checksum(data), OLD_GEN)
        dp.spend(OLD_GEN)  # what the daemon's commit does
        assert arena.invalidate(sealer, off, OLD_KEY, OLD_GEN)  # removed: the extent is free
        other = np.full(4096, 6, np.uint8)  # another block's bytes, written there since, not committed
        arena.array[off + HEADER_SIZE : off + HEADER_SIZE + other.size] = other
        assert _write(s, OLD_KEY, DRAM, off, np.full(4096, 0xEE, np.uint8), OLD_GEN) == EntryStatus.MISMATCH
        assert np.array_equal(arena.array[off + HEADER_SIZE : off + HEADER_SIZE + other.size], other)


def test_a_replayed_commit_does_not_seal_over_a_newer_block(port):
    """A commit of an older generation (a replayed or late control call) leaves a newer sealed
    block as it is; a commit repeated for the same block is fine."""
    _dp, sealer, arena, _ssd = port
    off = 0
    newer = np.full(4096, 7, np.uint8)
    _committed_dram(sealer, arena, off, NEW_KEY, newer, NEW_GEN)
    header = bytes(arena.view[off : off + HEADER_SIZE])
    assert not arena.commit(sealer, off, OLD_KEY, newer.size, checksum(newer), OLD_GEN)
    assert not arena.commit(sealer, off, OLD_KEY, newer.size, checksum(newer), NEW_GEN)  # same gen, other block
    assert bytes(arena.view[off : off + HEADER_SIZE]) == header
    assert arena.commit(sealer, off, NEW_KEY, newer.size, checksum(newer), NEW_GEN)  # a retry
    assert bytes(arena.view[off : off + HEADER_SIZE]) == header
