"""frames.recv_bytes over real sockets: the bytes as sent, whatever pieces they come in; None
when the peer closes before the first byte, ConnectionError when it closes part way, TimeoutError
when it trickles; and a length the peer announces sizes no buffer before its bytes arrive."""

from __future__ import annotations

import fcntl
import random
import socket
import struct
import termios
import threading
import time
import tracemalloc

import pytest

from kvstore.transport.frames import RECV_CHUNK, kernel_timeouts, recv_bytes

MB = 1 << 20


def _send_in_pieces(s: socket.socket, data: bytes, seed: int) -> None:
    r = random.Random(seed)
    at = 0
    while at < len(data):
        n = r.choice([1, 7, 1000, RECV_CHUNK - 1, RECV_CHUNK + 1, 300_000])
        s.sendall(data[at : at + n])
        at += n


@pytest.mark.parametrize("n", [0, 1, 20, RECV_CHUNK - 1, RECV_CHUNK, RECV_CHUNK + 1, 3 * MB + 7])
def test_bytes_as_sent(n):
    data = random.Random(n).randbytes(n)
    a, b = socket.socketpair()
    with a, b:
        t = threading.Thread(target=_send_in_pieces, args=(a, data + b"tail", n))
        t.start()
        got = recv_bytes(b, n)
        t.join()
        assert got == data and type(got) is bytes
        assert recv_bytes(b, 4) == b"tail"  # nothing past n was taken


@pytest.mark.parametrize("n", [20, 5 * MB])
def test_closed_before_the_first_byte(n):
    a, b = socket.socketpair()
    with b:
        a.close()
        assert recv_bytes(b, n) is None


@pytest.mark.parametrize(("n", "sent"), [(20, 3), (5 * MB, 10), (5 * MB, RECV_CHUNK), (5 * MB, 2 * MB + 1)])
def test_closed_part_way(n, sent):
    a, b = socket.socketpair()
    with b:
        t = threading.Thread(target=lambda: (a.sendall(bytes(sent)), a.close()))
        t.start()
        with pytest.raises(ConnectionError):
            recv_bytes(b, n)
        t.join()


def _unread(s: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_memory_follows_the_bytes_that_arrived():
    announced, sent = 256 * MB, 200_000
    a, b = socket.socketpair()
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            recv_bytes(b, announced)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t = threading.Thread(target=receive)
        t.start()
        a.sendall(bytes(sent))
        deadline = time.monotonic() + 10
        while _unread(b) and time.monotonic() < deadline:  # the receiver took it all
            time.sleep(0.01)
        a.close()
        t.join(10)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        b.close()
    assert [type(e) for e in errors] == [ConnectionError]
    # At most about twice what arrived, plus a chunk; never the announced length.
    assert peak < 4 * MB, peak


def _trickle(s: socket.socket, n: int, every_s: float, stop: threading.Event) -> None:
    for _ in range(n):
        if stop.is_set():
            return
        try:
            s.sendall(b"x")
        except OSError:
            return
        time.sleep(every_s)


def _pair(timeouts: str) -> tuple[socket.socket, socket.socket]:
    """A socket pair whose reading side waits at most 0.3 s for bytes: by a kernel timeout (the
    data port's plain sockets) or a Python-level one (TLS)."""
    a, b = socket.socketpair()
    if timeouts == "kernel":
        kernel_timeouts(b, 0.3)
    else:
        b.settimeout(0.3)
    return a, b


@pytest.mark.parametrize("timeouts", ["kernel", "python"])
def test_a_trickle_under_the_least_rate_is_a_stall_and_a_steady_stream_is_not(timeouts):
    """A byte every 0.05 s, each within the socket's 0.3 s timeout: the read raises TimeoutError
    once it has waited out the timeout at under the least rate (kernel timeouts: the data port's
    plain sockets; a Python-level one: TLS), instead of lasting as long as the trickle. 4 MiB
    sent in pieces with pauses shorter than the timeout arrives whole."""
    a, b = _pair(timeouts)
    with a, b:
        stop = threading.Event()
        t = threading.Thread(target=_trickle, args=(a, 200, 0.05, stop))
        t.start()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="stalled mid-read"):
            recv_bytes(b, 100)
        took = time.monotonic() - t0
        stop.set()
        t.join()
        assert took < 2.0  # the trickle would have lasted 10 s
    a, b = _pair(timeouts)
    with a, b:
        data = random.Random(5).randbytes(4 * MB)

        def steady() -> None:
            for i in range(0, len(data), MB // 2):
                a.sendall(data[i : i + MB // 2])
                time.sleep(0.1)

        t = threading.Thread(target=steady)
        t.start()
        assert recv_bytes(b, len(data)) == data
        t.join()
