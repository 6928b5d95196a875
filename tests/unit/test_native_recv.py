"""The per-entry part of a READ answer is received the same with the native loop
(kvstore/transport/copy.c recv_blocks) as with the Python one: statuses, payloads, checksums,
staged offsets, and the errors of a peer that closes or goes quiet mid-answer. Real sockets."""

from __future__ import annotations

import signal
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvstore.extent import checksum
from kvstore.transport import native
from kvstore.transport.frames import STAGED_AT, EntryStatus, kernel_timeouts
from kvstore.transport.tcp import TcpTransport

needs_native = pytest.mark.skipif(native.impl is None, reason="the native copy is not built here")
REGION = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8)


def answer(seed: int, n: int, staged: bool = False) -> tuple[list[tuple], list[int], bytes, list[bytes], list[int]]:
    """A random answer of ``n`` entries: (items, lengths, wire bytes, expected payloads,
    expected statuses); with ``staged``, some blocks come staged."""
    rng = np.random.default_rng(seed)
    items, lengths, wire, want, statuses = [], [], bytearray(), [], []
    for i in range(n):
        length = int(rng.choice([1, 17, 4096, 65536, 300_000, (2 << 20) + 3]))
        data = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        kind = int(rng.integers(0, 7))
        if kind == 5 and (not staged or length >= REGION.size):
            kind = 6
        csum = checksum(data)
        if kind == 0:  # bytes that do not match their checksum
            csum ^= 1
            wire += bytes([EntryStatus.OK]) + data
            statuses.append(EntryStatus.CHECKSUM)
        elif kind in (1, 2, 3):  # failures the daemon reports
            wire.append(kind)
            statuses.append(kind)
            data = None
        elif kind == 4:  # a status no daemon sends: not there
            wire.append(9)
            statuses.append(EntryStatus.MISMATCH)
            data = None
        elif kind == 5:  # staged: read from the region
            off = int(rng.integers(0, REGION.size - length))
            wire += STAGED_AT.pack(EntryStatus.STAGED, off)
            data = REGION[off : off + length].tobytes()
            csum = checksum(data)
            statuses.append(EntryStatus.OK)
        else:
            wire += bytes([EntryStatus.OK]) + data
            statuses.append(EntryStatus.OK)
        items.append((bytes(16), 1, 0, length, csum, i + 1, b""))
        lengths.append(length)
        want.append(data)
    return items, lengths, bytes(wire), want, statuses


def receive(
    wire: bytes, items: list[tuple], lengths: list[int], close_after: bool = False, staged: bool = False
) -> tuple[list, list]:
    a, b = socket.socketpair()
    kernel_timeouts(b, 2.0)
    region = SimpleNamespace(array=REGION, size=REGION.size)

    def send() -> None:
        try:
            a.sendall(wire)
        except OSError:
            pass  # the receiver gave up
        if close_after:
            a.close()

    t = threading.Thread(target=send)
    t.start()
    dests = [np.zeros(n, np.uint8) for n in lengths]
    try:
        msg = b"region\n1048576\n65536\n1" if staged else b""
        got = TcpTransport._recv_read(b, "peer", items, dests, msg, lambda *_: region)
    finally:
        b.close()
        t.join()
        a.close()
    return got, dests


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_native_and_python_receive_the_same(seed: int, monkeypatch):
    items, lengths, wire, want, statuses = answer(seed, 40)
    calls = []
    impl = native.impl
    spy = SimpleNamespace(recv_blocks=lambda *a: calls.append(1) or impl.recv_blocks(*a))
    with monkeypatch.context() as m:
        m.setattr(native, "impl", spy)
        got_native, dests_native = receive(wire, items, lengths)
    assert calls, "the native receive did not run"
    with monkeypatch.context() as m:
        m.setattr(native, "impl", None)
        got_py, dests_py = receive(wire, items, lengths)
    assert list(got_native) == list(got_py) == statuses
    for st, w, dn, dp in zip(statuses, want, dests_native, dests_py):
        if st == EntryStatus.OK:
            assert dn.tobytes() == dp.tobytes() == w


@pytest.mark.parametrize("use_native", [True, False])
def test_a_peer_that_closes_or_goes_quiet_mid_answer_is_an_error(use_native: bool, monkeypatch):
    if use_native and native.impl is None:
        pytest.skip("the native copy is not built here")
    if not use_native:
        monkeypatch.setattr(native, "impl", None)
    items, lengths, wire, _want, _st = answer(11, 8)
    with pytest.raises(ConnectionError):
        receive(wire[: len(wire) // 2], items, lengths, close_after=True)
    # Quiet: the socket's kernel timeout ends the wait (as an OSError, which the transport
    # turns into Unavailable).
    a, b = socket.socketpair()
    kernel_timeouts(b, 0.3)
    a.sendall(wire[: len(wire) // 2])
    with pytest.raises(OSError):
        TcpTransport._recv_read(b, "peer", items, [np.zeros(n, np.uint8) for n in lengths], b"", None)
    a.close()
    b.close()


@needs_native
def test_recv_blocks_refuses_bad_arguments():
    a, b = socket.socketpair()
    try:
        with pytest.raises(ValueError):
            native.impl.recv_blocks(b.fileno(), [np.zeros(4, np.uint8)], [])
        with pytest.raises((BufferError, TypeError)):
            native.impl.recv_blocks(b.fileno(), [b"read-only"], [0])
        with pytest.raises((ValueError, TypeError, OverflowError)):
            native.impl.recv_blocks(b.fileno(), [np.zeros(4, np.uint8)], [-1])
    finally:
        a.close()
        b.close()


class Interrupted(Exception):
    pass


@needs_native
@pytest.mark.parametrize("mid_payload", [False, True])
def test_a_signal_interrupts_the_native_receive_as_it_would_a_python_recv(mid_payload: bool):
    """Python's signal handlers run while the native loop waits (the GIL is taken back at
    EINTR), so a handler that raises ends the wait at once, not at the socket's timeout: between
    entries, and inside a payload large enough to be received piece by piece."""
    items, lengths, wire, _want, _st = answer(3, 4)
    if mid_payload:
        data = bytes(range(256)) * 4096  # 1 MiB: received and checksummed piece by piece
        items, lengths = [(bytes(16), 1, 0, len(data), checksum(data), 1, b"")], [len(data)]
        wire = bytes([EntryStatus.OK]) + data[:100_000]  # fits the socket buffer
    a, b = socket.socketpair()
    kernel_timeouts(b, 20.0)
    a.sendall(wire if mid_payload else wire[:3])  # part of an answer, then silence

    def handler(signum, frame):  # noqa: ANN001
        raise Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        start = time.monotonic()
        with pytest.raises(Interrupted):
            TcpTransport._recv_read(b, "peer", items, [np.zeros(n, np.uint8) for n in lengths], b"", None)
        assert time.monotonic() - start < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        a.close()
        b.close()


@pytest.mark.parametrize("seed", range(3))
def test_staged_answers_copy_each_block_from_the_region(seed: int):
    """A staged answer (a same-host SSD read) is received block by block, each staged block
    copied as its status arrives; streamed ones in it are checked as anywhere."""
    items, lengths, wire, want, statuses = answer(seed, 40, staged=True)
    got, dests = receive(wire, items, lengths, staged=True)
    assert list(got) == statuses
    for st, w, d in zip(statuses, want, dests):
        if st == EntryStatus.OK:
            assert d.tobytes() == w


@needs_native
def test_a_staged_block_in_an_answer_without_a_region_is_refused():
    items, lengths, wire, _want, statuses = answer(0, 40, staged=True)
    assert EntryStatus.OK in statuses
    with pytest.raises(ConnectionError):
        receive(wire, items, lengths, staged=False)
