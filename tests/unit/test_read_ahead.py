"""The data port begins a staged READ's SSD reads while the request before it on the connection
is still being served (kvstore.daemon.reads.NextRead). Real sockets, a real SSD segment on disk
and a real staging region: pipelined staged reads come back right and are taken ahead; a next
frame that must be refused is refused in its turn, after the whole answer before it, with its
reason and counted once; a frame that is not a staged SSD read is not taken ahead; half a next
frame does not hold up the answer before it; and a client that resets the connection mid-answer
gets its staging slice handed on only once no read still writes into it."""

from __future__ import annotations

import socket
import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvstore import tickets
from kvstore.daemon.arena import ShmArena
from kvstore.daemon.dataport import DataPort
from kvstore.daemon.ssd import SsdSegment
from kvstore.daemon.staging import Staging
from kvstore.extent import SSD_ALIGN, Sealer, checksum, extent_size
from kvstore.transport.frames import (
    ENTRY,
    MAGIC,
    REQ_HEAD,
    RESP_HEAD,
    STAGED,
    STAGED_AT,
    VERSION,
    EntryStatus,
    FrameStatus,
    Op,
    recv_bytes,
)
from kvstore.transport.tcp import TcpTransport

KEY = b"t" * 32  # the ticket key
SEG = 7
SIZE = 96 << 10


class Port(SimpleNamespace):
    port: DataPort
    ssd: SsdSegment
    staging: Staging
    items: list  # (key, segment_id, offset, length, checksum, gen, ticket) per block
    data: list


@pytest.fixture
def port(tmp_path) -> Port:  # noqa: ANN001
    sealer = Sealer(b"s" * 32)
    n = 24
    stride = extent_size(SIZE, SSD_ALIGN)
    ssd = SsdSegment(tmp_path / "ssd", SEG, n * stride, sealer=sealer, compress_policy="off")
    rng = np.random.default_rng(5)
    items, data = [], []
    for i in range(n):
        key, raw, gen = rng.bytes(16), rng.integers(0, 256, SIZE, dtype=np.uint8), 100 + i
        ssd.write(i * stride, key, raw, checksum(raw), gen)
        assert ssd.commit(i * stride, key, gen) is not None
        ticket = tickets.issue(KEY, tickets.READ, SEG, i * stride, SIZE, gen, key, 60)
        items.append((key, SEG, i * stride, SIZE, checksum(raw), gen, ticket))
        data.append(raw)
    # One slice whose halves hold two blocks each: every request of two blocks is staged whole.
    staging = Staging(tmp_path / "staging", 1, 2 * 2 * ssd.stage_bytes(0, SIZE))
    dp = DataPort("127.0.0.1", 0, lambda: {SEG: ssd}, sealer, ticket_key=KEY, staging=staging)
    dp.start()
    yield Port(port=dp, ssd=ssd, staging=staging, items=items, data=data)
    dp.stop()
    staging.close()
    ssd.close()


def _region(p: Port):  # noqa: ANN202 - the client's mapping of the staging region
    arena = ShmArena(p.staging.path, p.staging.size)
    return lambda *_a: SimpleNamespace(array=arena.array, size=arena.size)


def _assert_staged(port: Port, body: bytes, want: list) -> None:
    """Every entry of an answer's per-entry part came staged, with the bytes ``want`` says."""
    region = _region(port)()
    for j, data in enumerate(want):
        st, at = STAGED_AT.unpack_from(body, j * STAGED_AT.size)
        assert st == EntryStatus.STAGED
        assert np.array_equal(region.array[at : at + SIZE], data)


def _settles(cond) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 10
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cond()


def _frame(req_id: int, items: list, flags: int = STAGED) -> bytes:
    entries = []
    for key, seg, off, length, csum, gen, ticket in items:
        tag, expiry = tickets.TICKET.unpack(ticket)
        entries.append(ENTRY.pack(key, seg, expiry, off, length, csum, gen, tag))
    return REQ_HEAD.pack(MAGIC, VERSION, Op.READ, flags, req_id, len(entries)) + b"".join(entries)


def _answer(s: socket.socket, n: int) -> tuple[int, int, bytes, bytes]:
    """(frame status, request id, message, per-entry part) of one READ answer of staged blocks."""
    _m, status, _op, _f, rid, count, msg_len = RESP_HEAD.unpack(recv_bytes(s, RESP_HEAD.size))
    msg = recv_bytes(s, msg_len) if msg_len else b""
    body = recv_bytes(s, n * STAGED_AT.size) if status == FrameStatus.OK and count else b""
    return status, rid, msg, body


def test_pipelined_staged_reads_are_taken_ahead_and_come_back_right(port: Port):
    parts = [(port.items[i : i + 2], [np.zeros(SIZE, np.uint8) for _ in range(2)]) for i in range(0, 24, 2)]
    transport = TcpTransport()
    try:
        done, err = transport.read_parts(f"127.0.0.1:{port.port.port}", parts, STAGED, _region(port))
    finally:
        transport.close()
    assert err is None
    assert [st for statuses in done for st in statuses] == [EntryStatus.OK] * 24
    for k, (_items, dests) in enumerate(parts):
        for j, d in enumerate(dests):
            assert np.array_equal(d, port.data[2 * k + j]), (k, j)
    assert port.port.counters["staged"] == 24
    # Twelve requests, two in flight at a time: most were begun while the one before was served.
    assert port.port.counters["read_ahead_requests"] >= 6, port.port.counters
    _settles(lambda: port.port.active == 0)  # counted down once each answer is out


@pytest.mark.parametrize("bad", ["ticket", "segment"])
def test_a_next_frame_to_refuse_is_refused_in_its_turn_and_counted_once(port: Port, bad: str):
    good = _frame(1, port.items[:2])
    if bad == "ticket":  # another block's ticket
        key, seg, off, length, csum, gen, _t = port.items[3]
        worse = _frame(2, [port.items[2], (key, seg, off, length, csum, gen, port.items[4][6])])
    else:
        key, _seg, off, length, csum, gen, ticket = port.items[3]
        worse = _frame(2, [port.items[2], (key, SEG + 1, off, length, csum, gen, ticket)])
    with socket.create_connection(("127.0.0.1", port.port.port), timeout=10) as s:
        s.sendall(good + worse)
        status, rid, msg, body = _answer(s, 2)
        assert (status, rid) == (FrameStatus.OK, 1)
        _assert_staged(port, body, port.data[:2])
        status, rid, msg, _ = _answer(s, 2)
        assert (status, rid) == (FrameStatus.BAD_FRAME, 2)
        assert (b"ticket" if bad == "ticket" else b"unknown segment") in msg
        assert s.recv(1) == b""  # closed after a refusal
    assert port.port.counters["bad_frames"] == 1
    assert port.port.counters["ticket_refused"] == (1 if bad == "ticket" else 0)
    assert port.port.counters["read_ahead_requests"] == 0


def test_only_staged_ssd_reads_are_taken_ahead(port: Port):
    """A next frame that is not staged (another host's read: its blocks stream through the ring
    the answer before may still be sending from) waits for its turn."""
    frames = _frame(1, port.items[:2]) + _frame(2, port.items[2:4], flags=0)
    with socket.create_connection(("127.0.0.1", port.port.port), timeout=10) as s:
        s.sendall(frames)
        status, rid, _msg, _body = _answer(s, 2)
        assert (status, rid) == (FrameStatus.OK, 1)
        _m, status, _op, _f, rid, count, msg_len = RESP_HEAD.unpack(recv_bytes(s, RESP_HEAD.size))
        assert (status, rid, count, msg_len) == (FrameStatus.OK, 2, 2, 0)
        for j in (2, 3):  # streamed: status, then the bytes
            assert recv_bytes(s, 1)[0] == EntryStatus.OK
            assert recv_bytes(s, SIZE) == port.data[j].tobytes()
    assert port.port.counters["read_ahead_requests"] == 0


def test_a_next_frame_half_arrived_does_not_hold_up_the_answer_before_it(port: Port):
    first, second = _frame(1, port.items[:2]), _frame(2, port.items[2:4])
    with socket.create_connection(("127.0.0.1", port.port.port), timeout=10) as s:
        s.sendall(first + second[: len(second) // 2])
        status, rid, _msg, _body = _answer(s, 2)  # answered whole without the rest of the next
        assert (status, rid) == (FrameStatus.OK, 1)
        s.sendall(second[len(second) // 2 :])
        status, rid, _msg, body = _answer(s, 2)
        assert (status, rid) == (FrameStatus.OK, 2)
        _assert_staged(port, body, port.data[2:4])


def test_a_client_gone_mid_answer_frees_the_slice_only_once_its_reads_end(port: Port, monkeypatch):
    """Slow disk reads, and clients that reset the connection mid-answer (the daemon's send
    fails) with requests in flight and one taken ahead: the staging slice goes back (to be
    another connection's) only when no read is still writing into it."""
    lock, running, at_give = threading.Lock(), [0], []
    read = port.ssd.read

    def slow_read(*a, **k):  # noqa: ANN002, ANN003, ANN202
        with lock:
            running[0] += 1
        try:
            time.sleep(0.02)
            return read(*a, **k)
        finally:
            with lock:
                running[0] -= 1

    give = port.staging.give

    def giving(index: int) -> None:
        with lock:
            at_give.append(running[0])
        give(index)

    monkeypatch.setattr(port.ssd, "read", slow_read)
    monkeypatch.setattr(port.staging, "give", giving)
    frames = b"".join(_frame(k + 1, port.items[2 * k : 2 * k + 2]) for k in range(6))
    for n in range(32):
        s = socket.create_connection(("127.0.0.1", port.port.port), timeout=10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(frames)
        if n % 2:
            _answer(s, 2)
        time.sleep(0.003 * (n // 2))  # the reset comes at another point of the answers each time
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # reset: the daemon's next send fails
        _settles(lambda n=n: len(at_give) == n + 1)
    assert at_give == [0] * 32, at_give
    _settles(lambda: port.port.connections == 0)
    _settles(lambda: port.port.active == 0)  # a request taken ahead counted as served until it ended
