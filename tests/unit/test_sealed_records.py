"""Sealed records (kvstore.transport.sealed) over real socket pairs: bytes round-trip whatever
the record and read sizes; an altered, reordered, replayed, cut or foreign record, and a length
out of range, end the connection before any of its bytes are handed out."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.transport.frames import kernel_timeouts, recv_exact
from kvstore.transport.sealed import _LEN, GCM, MAX_RECORD, OCB3, SUITES, TAG, SealedSocket, _keys


def pair() -> tuple[SealedSocket, SealedSocket, socket.socket, socket.socket]:
    a, b = socket.socketpair()
    c2s, s2c = _keys(os.urandom(32), os.urandom(32))
    return SealedSocket(a, c2s, s2c), SealedSocket(b, s2c, c2s), a, b


def send_async(s: SealedSocket, *chunks) -> threading.Thread:  # noqa: ANN002
    def go() -> None:
        for c in chunks:
            s.sendall(c)

    t = threading.Thread(target=go)
    t.start()
    return t


@pytest.mark.parametrize("size", [1, 17, MAX_RECORD - 1, MAX_RECORD, MAX_RECORD + 1, 3 * MAX_RECORD + 5])
@pytest.mark.parametrize("read", [1, 4096, 2 << 20])
def test_bytes_round_trip_whatever_the_sizes(size, read):
    if read == 1 and size > 17:
        read = 999  # small reads of a large record, from the partly read record's buffer
    client, server, *_ = pair()
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    t = send_async(client, data, b"tail")
    out = np.zeros(size, np.uint8)
    view = memoryview(out)
    pos = 0
    while pos < size:
        got = server.recv_into(view[pos:], min(read, size - pos))
        assert got > 0
        pos += got
    tail = bytearray(4)
    assert recv_exact(server, memoryview(tail))
    t.join()
    assert np.array_equal(out, data) and bytes(tail) == b"tail"
    client.close()
    assert server.recv_into(bytearray(8)) == 0  # a clean end between records


def records(sock: socket.socket, count: int) -> list[bytes]:
    """``count`` whole records as they crossed the wire."""
    out = []
    for _ in range(count):
        head = bytearray(_LEN.size)
        recv_exact(sock, memoryview(head))
        body = bytearray(_LEN.unpack(head)[0] + TAG)
        recv_exact(sock, memoryview(body))
        out.append(bytes(head + body))
    return out


def relayed(change) -> tuple[SealedSocket, socket.socket]:  # noqa: ANN001
    """Two records of known bytes sealed by a sender, passed through ``change`` (a function of
    the list of raw records returning the bytes to deliver), and a receiver for them."""
    c2s, s2c = _keys(os.urandom(32), os.urandom(32))
    tap_w, tap_r = socket.socketpair()
    sender = SealedSocket(tap_w, c2s, s2c)
    sender.sendall(b"A" * 1000)
    sender.sendall(b"B" * 1000)
    raw = records(tap_r, 2)
    receiver_raw, deliver = socket.socketpair()
    deliver.sendall(change(raw))
    deliver.shutdown(socket.SHUT_WR)
    tap_w.close()
    tap_r.close()
    return SealedSocket(receiver_raw, s2c, c2s), deliver


def read_all(s: SealedSocket) -> bytes:
    out = bytearray()
    buf = bytearray(4096)
    while True:
        n = s.recv_into(buf)
        if not n:
            return bytes(out)
        out += buf[:n]


def test_untouched_records_read_back():
    r, _ = relayed(lambda raw: b"".join(raw))
    assert read_all(r) == b"A" * 1000 + b"B" * 1000


@pytest.mark.parametrize(
    "attack",
    [
        "flip a ciphertext byte",
        "flip a tag byte",
        "change the length",
        "swap the records",
        "replay the first",
        "drop the first",
        "cut the second",
    ],
)
def test_a_changed_stream_ends_the_connection_before_its_bytes_are_used(attack):
    def change(raw: list[bytes]) -> bytes:
        a, b = bytearray(raw[0]), bytearray(raw[1])
        if attack == "flip a ciphertext byte":
            a[_LEN.size + 10] ^= 1
        elif attack == "flip a tag byte":
            a[-1] ^= 0x80
        elif attack == "change the length":
            a[0:4] = _LEN.pack(999)
        elif attack == "swap the records":
            a, b = b, a
        elif attack == "replay the first":
            b = bytearray(a)
        elif attack == "drop the first":
            a = bytearray()
        elif attack == "cut the second":
            b = b[: len(b) // 2]
        return bytes(a + b)

    r, _ = relayed(change)
    got = bytearray()
    buf = bytearray(4096)
    with pytest.raises(ConnectionError):
        while True:
            n = r.recv_into(buf)
            assert n, "the stream ended cleanly although it was changed"
            got += buf[:n]
    # Whatever was handed out before the error is exactly what was sealed, in order.
    assert bytes(got) == (b"A" * 1000 + b"B" * 1000)[: len(got)]
    assert len(got) in (0, 1000)


@pytest.mark.parametrize("length", [0, MAX_RECORD + 1, 2**32 - 1])
def test_a_length_out_of_range_is_refused_before_anything_is_read(length):
    client, server, a, b = pair()
    a.sendall(_LEN.pack(length) + b"x" * 64)
    with pytest.raises(ConnectionError, match="outside"):
        server.recv_into(bytearray(16))


def test_records_of_another_connection_do_not_open():
    c1, s1, a1, b1 = pair()
    c2, s2, a2, b2 = pair()
    c1.sendall(b"secret" * 100)
    wire = records(b1, 1)[0]
    a2.sendall(wire)  # delivered to the second connection's server
    with pytest.raises(ConnectionError, match="authentication"):
        s2.recv_into(bytearray(600))


def test_the_key_schedule_gives_each_direction_its_own_key():
    cr, sr = os.urandom(32), os.urandom(32)
    c2s, s2c = _keys(cr, sr)
    nonce = bytes(12)
    sealed = c2s.encrypt(nonce, b"x" * 32, b"")
    with pytest.raises(Exception):  # noqa: B017 - cryptography's InvalidTag
        s2c.decrypt(nonce, sealed, b"")
    again, _ = _keys(cr, sr)
    assert again.decrypt(nonce, sealed, b"") == b"x" * 32
    other, _ = _keys(os.urandom(32), sr)
    assert isinstance(other, SUITES[OCB3])
    with pytest.raises(Exception):  # noqa: B017
        other.decrypt(nonce, sealed, b"")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2048), st.integers(0, MAX_RECORD + 64))
def test_random_bytes_never_open(noise, claimed):
    """Whatever an attacker without the keys sends (a claimed length, then noise), the receiver
    hands out no byte: it ends the connection, or sees a clean end of an empty stream."""
    receiver_raw, deliver = socket.socketpair()
    c2s, s2c = _keys(os.urandom(32), os.urandom(32))
    r = SealedSocket(receiver_raw, s2c, c2s)
    payload = (_LEN.pack(claimed) + noise) if claimed else noise
    deliver.sendall(payload)
    deliver.close()
    try:
        got = r.recv_into(bytearray(MAX_RECORD))
    except ConnectionError:
        got = 0
    finally:
        r.close()
    assert got == 0


@pytest.mark.parametrize("suite", [OCB3, GCM])
def test_each_suite_round_trips_and_the_suite_is_part_of_the_keys(suite):
    cr, sr = os.urandom(32), os.urandom(32)
    a, b = socket.socketpair()
    c2s, s2c = _keys(cr, sr, suite)
    client, server = SealedSocket(a, c2s, s2c), SealedSocket(b, s2c, c2s)
    client.sendall(b"z" * 5000)
    out = bytearray(5000)
    assert recv_exact(server, memoryview(out)) and out == b"z" * 5000
    other = GCM if suite == OCB3 else OCB3
    c2s_other, _ = _keys(cr, sr, other)
    nonce = bytes(12)
    with pytest.raises(Exception):  # noqa: B017 - another suite's key opens nothing
        c2s_other.decrypt(nonce, c2s.encrypt(nonce, b"x" * 16, b""), b"")


def test_a_record_that_fails_leaves_zeros_in_the_callers_buffer():
    def flip(raw: list[bytes]) -> bytes:
        a = bytearray(raw[0])
        a[-1] ^= 1  # the tag
        return bytes(a + raw[1])

    r, _ = relayed(flip)
    buf = bytearray(b"\xff" * 1000)
    with pytest.raises(ConnectionError, match="authentication"):
        r.recv_into(buf, 1000)
    assert buf == bytes(1000), "bytes of a record that failed authentication were left in the buffer"


def test_nbytes_beyond_the_buffer_is_refused_like_a_socket_does():
    client, server, *_ = pair()
    client.sendall(b"abc")
    with pytest.raises(ValueError):
        server.recv_into(bytearray(2), 3)
    assert server.recv_into(bytearray(3)) == 3  # nothing was consumed by the refused call


@pytest.mark.parametrize("daemon_has_ocb", [True, False])
def test_the_upgrade_over_real_tls_agrees_on_a_suite_and_leaves_tls(tmp_path, monkeypatch, daemon_has_ocb):
    """A mutual-TLS pair upgrades: the daemon takes the client's suite if it runs it, else
    AES-GCM; both then move bytes in sealed records over the bare TCP stream."""
    import ssl

    from kvstore import certs
    from kvstore.tls import TlsConfig, client_context, server_context
    from kvstore.transport import sealed

    certs.make(tmp_path, ("daemon", "client"))

    def tls(name: str) -> TlsConfig:
        return TlsConfig(str(tmp_path / "ca.pem"), str(tmp_path / f"{name}.pem"), str(tmp_path / f"{name}.key"))

    srv_ctx, cli_ctx = server_context(tls("daemon")), client_context(tls("client"))
    real = sealed.available

    def available(suite: int) -> bool:
        if threading.current_thread().name == "daemon" and not daemon_has_ocb and suite == OCB3:
            return False
        return real(suite)

    monkeypatch.setattr(sealed, "available", available)
    a, b = socket.socketpair()
    got: dict = {}

    def daemon() -> None:
        t = srv_ctx.wrap_socket(b, server_side=True)
        head = bytearray(len(sealed.UPGRADE))
        recv_exact(t, memoryview(head))
        assert bytes(head) == sealed.UPGRADE
        rest = bytearray(sealed.REQUEST_BYTES - len(sealed.UPGRADE))
        recv_exact(t, memoryview(rest))
        s = sealed.server_upgrade(t, bytes(rest))
        buf = bytearray(11)
        recv_exact(s, memoryview(buf))
        got["daemon"] = bytes(buf)
        got["suite"] = type(s._send)
        s.sendall(b"pong" * 1000)

    th = threading.Thread(target=daemon, name="daemon")
    th.start()
    c = sealed.client_upgrade(cli_ctx.wrap_socket(a, server_hostname="kvstore"))
    assert not isinstance(c.sock, ssl.SSLSocket) or c.sock._sslobj is None  # TLS is left
    c.sendall(b"hello world")
    out = bytearray(4000)
    assert recv_exact(c, memoryview(out)) and out == b"pong" * 1000
    th.join(10)
    assert got["daemon"] == b"hello world"
    assert got["suite"] is (SUITES[OCB3] if daemon_has_ocb else SUITES[GCM])
    assert type(c._send) is got["suite"]


def test_a_read_of_many_records_through_recv_exact_is_whole_with_kernel_timeouts():
    """As the data port and its client read a block over sealed records: one recv_exact of a
    payload several records long, on sockets with kernel timeouts (SealedSocket answers at most
    a record per call, and the stall rule asks it for its wait bound)."""
    client, server, a, b = pair()
    kernel_timeouts(a, 5.0)
    kernel_timeouts(b, 5.0)
    assert server.gettimeout() == pytest.approx(5.0)
    data = np.random.default_rng(3).integers(0, 256, 3 * MAX_RECORD + 5, dtype=np.uint8)
    t = send_async(client, data)
    out = np.zeros(data.size, np.uint8)
    assert recv_exact(server, memoryview(out))
    t.join()
    assert np.array_equal(out, data)


def test_a_record_trickled_in_is_a_stall():
    """A peer sending a sealed record a byte at a time, each within the 0.3 s timeout: the
    reader gives up with TimeoutError instead of waiting as long as the trickle lasts."""
    c2s, s2c = _keys(os.urandom(32), os.urandom(32))
    a, b = socket.socketpair()
    SealedSocket(a, c2s, s2c).sendall(b"x" * 400)
    wire = records(b, 1)[0]
    a.close()
    b.close()
    a, b = socket.socketpair()
    kernel_timeouts(b, 0.3)
    server = SealedSocket(b, s2c, c2s)
    stop = threading.Event()

    def trickle() -> None:
        for byte in wire:
            if stop.is_set():
                return
            a.sendall(bytes([byte]))
            time.sleep(0.05)

    t = threading.Thread(target=trickle)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        recv_exact(server, memoryview(bytearray(400)))
    stop.set()
    t.join()
    a.close()
    b.close()
    assert time.monotonic() - t0 < 3.0  # the trickle would have lasted 20 s
