"""frames.send_parts: a head and its payload arrive whole and in order, whether the socket takes
them in one system call, in several (a payload larger than the socket's buffer), or the channel is
not a plain socket (one send after the other)."""

from __future__ import annotations

import socket
import threading

import numpy as np

from kvstore.transport.frames import recv_exact, send_parts


def _roundtrip(size: int) -> None:
    a, b = socket.socketpair()
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    got = bytearray(3 + size)
    reader = threading.Thread(target=lambda: recv_exact(b, memoryview(got)))
    reader.start()
    try:
        send_parts(a, b"\x01\x02\x03", payload)
        reader.join(10)
        assert not reader.is_alive()
        assert bytes(got[:3]) == b"\x01\x02\x03"
        assert bytes(got[3:]) == payload.tobytes()
    finally:
        a.close()
        b.close()


def test_small_payload_goes_whole():
    _roundtrip(1000)


def test_payload_larger_than_the_socket_buffer_goes_whole():
    _roundtrip(16 << 20)


def test_a_channel_that_is_not_a_plain_socket_gets_two_sends():
    class Channel:
        def __init__(self) -> None:
            self.parts: list[bytes] = []

        def sendall(self, data) -> None:  # noqa: ANN001
            self.parts.append(bytes(data))

    ch = Channel()
    send_parts(ch, b"\x07", memoryview(b"payload"))  # type: ignore[arg-type]
    assert ch.parts == [b"\x07", b"payload"]
