"""A put's DRAM block is committed only over its writer's stamp: a commit that names the checksum
of bytes the extent held before (another block's, since removed) or of a write cut short seals
nothing, so those bytes are never served as the new block. A real DataPort on loopback, a real
DRAM arena and the daemon's commit operation (kvstore.daemon.operations.SegmentOps)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from conftest import recv_all
from test_dataport_stale_write import DRAM, MB, NEW_GEN, NEW_KEY, OLD_GEN, OLD_KEY, _entry, _read, _write, port  # noqa: F401

from kvstore.daemon.arena import ShmArena
from kvstore.daemon.operations import SegmentOps
from kvstore.extent import HEADER_SIZE, WRITTEN_MAGIC, Stamper, checksum
from kvstore.keys import pack_keys
from kvstore.transport.frames import MAGIC, REQ_HEAD, RESP_HEAD, VERSION, EntryStatus, Op
from kvstore.transport.shm import ShmTransport
from kvstore.v1 import common_pb2, daemon_pb2
from kvstore.wire import U64, pack, unpack

LENGTH = 64 * 1024


def _commit(ops: SegmentOps, key: bytes, off: int, data: np.ndarray, gen: int) -> int:
    req = daemon_pb2.CommitRequest(
        keys=pack_keys([key]),
        segment=pack([DRAM], np.dtype("<u4")),
        offset=pack([off], U64),
        length=pack([data.size], U64),
        checksum=pack([checksum(data)], U64),
        gen=pack([gen], U64),
    )
    resp = ops.commit(req)
    return unpack(resp.status, np.dtype("u1"), "status", 1)[0]


@pytest.fixture
def ops(port):  # noqa: F811 - the fixture imported above
    dp, sealer, arena, _ssd = port
    return dp, sealer, arena, SegmentOps({DRAM: arena}, sealer, {"commits": 0})


def test_a_commit_over_the_bytes_of_a_removed_block_is_refused(ops):
    dp, sealer, arena, seg_ops = ops
    x = np.random.default_rng(1).integers(0, 256, LENGTH, np.uint8)
    with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as s:
        assert _write(s, OLD_KEY, DRAM, 0, x, OLD_GEN) == EntryStatus.OK
        assert _commit(seg_ops, OLD_KEY, 0, x, OLD_GEN) == common_pb2.COMMIT_OK
        assert arena.invalidate(sealer, 0, OLD_KEY, OLD_GEN)  # removed; the payload stays
        # Another put reserves the same extent and commits it, unwritten, naming X's checksum.
        assert _commit(seg_ops, NEW_KEY, 0, x, NEW_GEN) == common_pb2.COMMIT_MISMATCH
        assert sealer.parse(arena.view, 0) is None
        st, _ = _read(s, NEW_KEY, DRAM, 0, LENGTH, NEW_GEN)
        assert st != EntryStatus.OK
        # Written now, the same commit goes through, and a retry of it too.
        y = np.random.default_rng(2).integers(0, 256, LENGTH, np.uint8)
        assert _write(s, NEW_KEY, DRAM, 0, y, NEW_GEN) == EntryStatus.OK
        assert _commit(seg_ops, NEW_KEY, 0, y, NEW_GEN) == common_pb2.COMMIT_OK
        assert _commit(seg_ops, NEW_KEY, 0, y, NEW_GEN) == common_pb2.COMMIT_OK
        st, got = _read(s, NEW_KEY, DRAM, 0, LENGTH, NEW_GEN)
        assert st == EntryStatus.OK and got == y.tobytes()


def test_a_write_cut_short_or_failing_its_checksum_leaves_no_stamp(ops):
    dp, _sealer, arena, seg_ops = ops
    data = np.full(LENGTH, 5, np.uint8)
    with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as s:
        e = _entry(Op.WRITE, NEW_KEY, DRAM, 0, LENGTH, checksum(data), NEW_GEN)
        s.sendall(REQ_HEAD.pack(MAGIC, VERSION, Op.WRITE, 0, 1, 1) + e)
        s.sendall(memoryview(data)[: LENGTH // 4])  # a quarter, then the writer goes away
    deadline = time.monotonic() + 10
    while dp.connections and time.monotonic() < deadline:  # the port saw the writer go
        time.sleep(0.01)
    assert dp.connections == 0
    assert not arena.written(0, NEW_GEN)
    assert _commit(seg_ops, NEW_KEY, 0, data, NEW_GEN) == common_pb2.COMMIT_MISMATCH
    other = np.full(LENGTH, 6, np.uint8)
    with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as s:
        e = _entry(Op.WRITE, NEW_KEY, DRAM, 0, LENGTH, checksum(data), NEW_GEN)  # names data's checksum
        s.sendall(REQ_HEAD.pack(MAGIC, VERSION, Op.WRITE, 0, 1, 1) + e + other.tobytes())
        RESP_HEAD.unpack(recv_all(s, RESP_HEAD.size))
        assert recv_all(s, 1)[0] == EntryStatus.CHECKSUM
    assert not arena.written(0, NEW_GEN)
    assert _commit(seg_ops, NEW_KEY, 0, data, NEW_GEN) == common_pb2.COMMIT_MISMATCH


def test_a_shared_memory_write_stamps_its_own_generation_only(ops):
    _dp, sealer, arena, seg_ops = ops
    data = np.random.default_rng(3).integers(0, 256, LENGTH, np.uint8)
    assert ShmTransport.write(arena, 4 * MB, data, OLD_GEN)
    assert arena.written(4 * MB, OLD_GEN) and not arena.written(4 * MB, NEW_GEN)
    assert bytes(arena.view[4 * MB : 4 * MB + 4]) == WRITTEN_MAGIC
    # The extent given to a later put, with the earlier writer's stamp still there: refused.
    assert _commit(seg_ops, NEW_KEY, 4 * MB, data, NEW_GEN) == common_pb2.COMMIT_MISMATCH
    assert _commit(seg_ops, OLD_KEY, 4 * MB, data, OLD_GEN) == common_pb2.COMMIT_OK
    h = sealer.parse(arena.view, 4 * MB)
    assert h is not None and (h.key, h.gen) == (OLD_KEY, OLD_GEN)
    payload = arena.array[4 * MB + HEADER_SIZE : 4 * MB + HEADER_SIZE + LENGTH]
    assert np.array_equal(payload, data)


def test_a_duplicate_write_ending_after_the_commit_leaves_the_sealed_header_whole(ops):
    """Two writes with the same ticket, the slower ending after the faster one's block was
    committed: the slower one is answered MISMATCH and stamps nothing over the sealed header (a
    stamp there would turn the committed block into a miss)."""
    dp, sealer, arena, seg_ops = ops
    data = np.random.default_rng(4).integers(0, 256, LENGTH, np.uint8)
    e = _entry(Op.WRITE, NEW_KEY, DRAM, 0, LENGTH, checksum(data), NEW_GEN)
    with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as slow:
        slow.sendall(REQ_HEAD.pack(MAGIC, VERSION, Op.WRITE, 0, 1, 1) + e + data[: LENGTH // 2].tobytes())
        time.sleep(0.3)  # the port has checked the entry and receives the payload
        with socket.create_connection(("127.0.0.1", dp.port), timeout=10) as fast:
            assert _write(fast, NEW_KEY, DRAM, 0, data, NEW_GEN) == EntryStatus.OK
        assert _commit(seg_ops, NEW_KEY, 0, data, NEW_GEN) == common_pb2.COMMIT_OK
        slow.sendall(data[LENGTH // 2 :].tobytes())
        RESP_HEAD.unpack(recv_all(slow, RESP_HEAD.size))
        assert recv_all(slow, 1)[0] == EntryStatus.MISMATCH
        h = sealer.parse(arena.view, 0)
        assert h is not None and (h.key, h.gen) == (NEW_KEY, NEW_GEN)
        st, got = _read(slow, NEW_KEY, DRAM, 0, LENGTH, NEW_GEN)
        assert st == EntryStatus.OK and got == data.tobytes()


def test_a_stamp_needs_the_arena_key_which_a_same_host_mapping_reads_and_a_remote_writer_lacks(ops, tmp_path):
    """A stamp is keyed: bytes a remote writer planted where a later extent's header will be
    (the magic and a generation it guessed, with a MAC under any other key) do not pass, so it
    cannot commit that extent unwritten. A client's own mapping of the arena reads the key next
    to it and stamps what the daemon accepts; a mapping that finds no key (a daemon older than
    the stamp) writes without one (that daemon commits without), and with
    ``daemon.require_write_stamp`` off (a rolling upgrade) an unstamped write commits."""
    dp, sealer, arena, seg_ops = ops
    data = np.random.default_rng(5).integers(0, 256, LENGTH, np.uint8)
    off = 8 * MB
    arena.array[off + HEADER_SIZE : off + HEADER_SIZE + LENGTH] = data
    for forged in (
        Stamper(b"f" * 32).stamp(off, NEW_GEN),
        WRITTEN_MAGIC + bytes(4) + NEW_GEN.to_bytes(8, "little") + bytes(8),
    ):
        arena.view[off : off + Stamper.SIZE] = forged
        assert not arena.written(off, NEW_GEN)
        assert _commit(seg_ops, NEW_KEY, off, data, NEW_GEN) == common_pb2.COMMIT_MISMATCH
    client = ShmArena(arena.path, arena.size)
    try:
        assert ShmTransport.write(client, off, data, NEW_GEN)
        assert arena.written(off, NEW_GEN)
        assert _commit(seg_ops, NEW_KEY, off, data, NEW_GEN) == common_pb2.COMMIT_OK
    finally:
        client.close()
    other = tmp_path / "keyless"
    ShmArena(other, MB, create=True).close()
    (tmp_path / "keyless.stamp").unlink()
    keyless = ShmArena(other, MB)
    try:
        assert ShmTransport.write(keyless, 0, data[:4096], NEW_GEN)
        assert not keyless.written(0, NEW_GEN)
        assert bytes(keyless.view[:HEADER_SIZE]) == bytes(HEADER_SIZE)
    finally:
        keyless.close()
    lenient = SegmentOps({DRAM: arena}, sealer, {"commits": 0}, require_stamp=False)
    off = 12 * MB
    arena.clear_header(off)
    arena.array[off + HEADER_SIZE : off + HEADER_SIZE + LENGTH] = data
    assert _commit(seg_ops, OLD_KEY, off, data, OLD_GEN) == common_pb2.COMMIT_MISMATCH
    assert _commit(lenient, OLD_KEY, off, data, OLD_GEN) == common_pb2.COMMIT_OK
