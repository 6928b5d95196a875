"""frames.send_vec: buffers arrive whole and in order, whether the socket takes them in one
system call or in several (more buffers than one sendmsg takes, a payload larger than the
socket's buffer), or the channel is not a plain socket (one send after the other)."""

from __future__ import annotations

import socket
import threading

import numpy as np

from kvstore.transport.frames import MAX_IOV, recv_exact, send_vec


def _roundtrip(parts: list) -> None:
    want = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    a, b = socket.socketpair()
    got = bytearray(len(want))
    reader = threading.Thread(target=lambda: recv_exact(b, memoryview(got)))
    reader.start()
    try:
        send_vec(a, parts)
        reader.join(10)
        assert not reader.is_alive()
        assert bytes(got) == want
    finally:
        a.close()
        b.close()


def _payload(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def test_a_head_and_a_small_payload_go_whole():
    _roundtrip([b"\x01\x02\x03", _payload(1000, 1)])


def test_a_payload_larger_than_the_socket_buffer_goes_whole():
    _roundtrip([b"\x01", _payload(16 << 20, 2), b"\x02"])


def test_more_buffers_than_one_sendmsg_takes_go_in_order():
    parts: list = []
    for i in range(3 * MAX_IOV + 7):
        parts += [bytes((i % 251,)), _payload(1 + i % 300, i)]
    _roundtrip(parts)


def test_typed_arrays_go_as_their_bytes():
    _roundtrip([np.arange(1000, dtype=np.float32), b"", np.arange(7, dtype=np.uint16)])


def test_a_channel_that_is_not_a_plain_socket_gets_one_send_per_buffer():
    class Channel:
        def __init__(self) -> None:
            self.parts: list[bytes] = []

        def sendall(self, data) -> None:  # noqa: ANN001
            self.parts.append(bytes(data))

    ch = Channel()
    send_vec(ch, [b"\x07", memoryview(b"payload")])  # type: ignore[arg-type]
    assert ch.parts == [b"\x07", b"payload"]
