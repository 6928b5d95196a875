"""Sealed bulk records for the TCP data port: what a connection carries after its mutual-TLS
handshake, when the client asks for it.

Python's ``ssl`` moves one TLS record (at most 16 KiB) per call, and spends more CPU on that
record handling than on AES-GCM itself (``bench/store_throughput.py`` measures both). Kernel TLS
would avoid it, but needs Python 3.12 and the kernel's ``tls`` module. So, as kernel TLS splits
the handshake from the record layer, the data port lets TLS authenticate both ends and agree on
secrets, and then carries the bulk bytes in its own AEAD records: a key per direction, the
record's sequence number as its nonce, up to 1 MiB per record, which costs one
``encrypt_into`` / ``decrypt_into`` call (OpenSSL, without the GIL) per MiB.

The AEAD is AES-128 in OCB3 mode (RFC 7253) where OpenSSL offers it: one AES pass per block and
no GHASH, about twice AES-GCM's rate on the benchmark machine (0.37 against 0.74 CPU seconds
per GB sealed and opened). Where it does not (a FIPS-only OpenSSL), AES-128-GCM. Either rests on
AES and on nonces never repeating under a key, which per-connection keys and the record counter
guarantee.

Upgrade, right after the TLS handshake and inside TLS::

    client -> server   "KVS1" | suite u8 (the client's choice) | 32 random bytes
    server -> client   "KVS1" | suite u8 (the client's, if the daemon has it, else AES-GCM) | 32 random bytes
    both               TLS close_notify (``unwrap``): the TCP stream carries sealed records from here

Keys: HKDF-SHA256 over both random strings and the suite (secret: TLS carried them,
confidential and authenticated by both certificates), one 128-bit key per direction. A record::

    length u32 (little-endian, 1 .. MAX_RECORD; the AEAD's associated data) | ciphertext | tag 16 B

with nonce = 4 zero bytes | u64 sequence number of the record in its direction, from 0. A record
that does not authenticate (altered, replayed, reordered, cut short, or from another connection)
ends the connection with ``ConnectionError``, and the buffer it was being opened into is zeroed
first, so no byte of it is handed out; a length out of range ends it before anything is read.
Records carry no end-of-stream mark: a stream cut between records reads as a closed connection,
and the data port's frames (whose lengths say how much must follow) turn that into an error.
"""

from __future__ import annotations

import functools
import os
import socket
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESOCB3
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstore.transport.frames import kernel_timeouts, recv_exact, wait_bound

UPGRADE = b"KVS1"
RANDOM_BYTES = 32
MAX_RECORD = 1 << 20
TAG = 16
_LEN = struct.Struct("<I")
_SALT = b"kvstore data port sealed records v1"
OCB3, GCM = 1, 2
SUITES = {OCB3: AESOCB3, GCM: AESGCM}
REQUEST_BYTES = len(UPGRADE) + 1 + RANDOM_BYTES


@functools.cache
def available(suite: int) -> bool:
    """Whether this process's OpenSSL runs ``suite``."""
    try:
        aead = SUITES[suite](bytes(16))
        aead.decrypt(bytes(12), aead.encrypt(bytes(12), b"x", b""), b"")
        return True
    except Exception:  # noqa: BLE001 - UnsupportedAlgorithm, or anything a provider raises
        return False


def preferred() -> int:
    return OCB3 if available(OCB3) else GCM


def AEAD(key: bytes):  # noqa: N802, ANN201 - the suite this process prefers, for measurements
    return SUITES[preferred()](key)


def _keys(client_random: bytes, server_random: bytes, suite: int = OCB3) -> tuple:
    """(client -> server, server -> client) AEADs from both sides' random strings."""

    def one(label: bytes):  # noqa: ANN202
        kdf = HKDF(algorithm=hashes.SHA256(), length=16, salt=_SALT, info=label + bytes((suite,)))
        return SUITES[suite](kdf.derive(client_random + server_random))

    return one(b"client to server"), one(b"server to client")


def _recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fills ``view``: its length, or 0 if the peer closed before the first byte (ConnectionError
    if part way, TimeoutError if it trickles: :func:`kvstore.transport.frames.recv_exact`)."""
    return len(view) if recv_exact(sock, view) else 0


class SealedSocket:
    """A socket-like object over a TCP socket whose bytes are sealed records: ``sendall``,
    ``recv_into``, ``shutdown``, ``close``, as the data port and its client use them. Not shared
    between threads (the data port serves a connection on one thread; the client pools them).
    Buffers grow with the records seen (at most 1 MiB each), so connections that move small
    blocks stay small."""

    def __init__(self, sock: socket.socket, send, recv) -> None:  # noqa: ANN001 - AEADs
        self.sock = sock
        self._send, self._recv = send, recv
        self._send_seq = 0
        self._recv_seq = 0
        self._out = bytearray()
        self._in = bytearray()
        self._plain = bytearray()  # a record's plaintext the reader took only part of
        self._plain_at = 0
        self._plain_end = 0

    def gettimeout(self) -> float | None:
        """The wait bound of the socket under the records (what a read measures a stall by)."""
        return wait_bound(self.sock)

    @staticmethod
    def _nonce(seq: int) -> bytes:
        return b"\0\0\0\0" + seq.to_bytes(8, "little")

    @staticmethod
    def _room(buf: bytearray, n: int) -> memoryview:
        if len(buf) < n:
            buf.extend(bytes(n - len(buf)))
        return memoryview(buf)

    def sendall(self, data) -> None:  # noqa: ANN001 - bytes-like
        view = memoryview(data).cast("B")
        out = self._room(self._out, _LEN.size + min(len(view), MAX_RECORD) + TAG)
        for at in range(0, len(view), MAX_RECORD):
            chunk = view[at : at + MAX_RECORD]
            n = len(chunk)
            head = _LEN.pack(n)
            out[: _LEN.size] = head
            self._send.encrypt_into(self._nonce(self._send_seq), chunk, head, out[_LEN.size : _LEN.size + n + TAG])
            self._send_seq += 1
            self.sock.sendall(out[: _LEN.size + n + TAG])

    def _next_length(self) -> tuple[int, bytes]:
        """The next record's length and header; (0, b"") at a clean end of the stream."""
        head = bytearray(_LEN.size)
        got = _recv_exact(self.sock, memoryview(head))
        if got == 0:
            return 0, b""
        if got < _LEN.size:
            raise ConnectionError("sealed record cut short in its length")
        (n,) = _LEN.unpack(head)
        if not 0 < n <= MAX_RECORD:
            raise ConnectionError(f"sealed record length {n} is outside 1..{MAX_RECORD}")
        return n, bytes(head)

    def _open(self, n: int, head: bytes, dest: memoryview) -> None:
        """Reads the body of a record of ``n`` bytes and opens it into ``dest`` (``n`` bytes);
        on any failure ``dest`` is zeroed before the error is raised."""
        body = self._room(self._in, n + TAG)[: n + TAG]
        try:
            if _recv_exact(self.sock, body) < n + TAG:
                raise ConnectionError("sealed record cut short")
            try:
                self._recv.decrypt_into(self._nonce(self._recv_seq), body, head, dest)
            except InvalidTag:
                raise ConnectionError("sealed record failed authentication") from None
        except BaseException:
            dest[:] = bytes(len(dest))
            raise
        self._recv_seq += 1

    def recv_into(self, buffer, nbytes: int = 0) -> int:  # noqa: ANN001 - writable bytes-like
        view = memoryview(buffer).cast("B")
        if nbytes < 0 or nbytes > len(view):
            raise ValueError(f"nbytes {nbytes} is outside the buffer of {len(view)} bytes")
        want = nbytes or len(view)
        if self._plain_at == self._plain_end:
            if want == 0:
                return 0
            n, head = self._next_length()
            if n == 0:
                return 0
            if n <= want:  # the whole record fits: opened straight into the caller's buffer
                self._open(n, head, view[:n])
                return n
            self._open(n, head, self._room(self._plain, n)[:n])
            self._plain_at, self._plain_end = 0, n
        n = min(want, self._plain_end - self._plain_at)
        view[:n] = memoryview(self._plain)[self._plain_at : self._plain_at + n]
        self._plain_at += n
        return n

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()

    def fileno(self) -> int:
        return self.sock.fileno()


def _leave_tls(tls_sock) -> socket.socket:  # noqa: ANN001 - ssl.SSLSocket
    """TLS's close_notify, then the TCP socket under it. The Python-level timeout TLS needed
    becomes kernel timeouts on a blocking socket (frames.kernel_timeouts): records are read
    with plain recv calls."""
    timeout = tls_sock.gettimeout()
    sock = tls_sock.unwrap()
    if timeout is not None:
        kernel_timeouts(sock, timeout)
    return sock


def client_upgrade(tls_sock) -> SealedSocket:  # noqa: ANN001 - ssl.SSLSocket
    """The client's side: asks for sealed records inside TLS, then leaves TLS."""
    mine, want = os.urandom(RANDOM_BYTES), preferred()
    tls_sock.sendall(UPGRADE + bytes((want,)) + mine)
    reply = bytearray(REQUEST_BYTES)
    if _recv_exact(tls_sock, memoryview(reply)) < len(reply) or reply[: len(UPGRADE)] != UPGRADE:
        raise ConnectionError("the data port did not accept sealed records (a daemon older than this client?)")
    suite = reply[len(UPGRADE)]
    if suite not in (want, GCM) or not available(suite):
        raise ConnectionError(f"the data port chose sealed-record suite {suite}, which was not offered")
    c2s, s2c = _keys(mine, bytes(reply[len(UPGRADE) + 1 :]), suite)
    sock = _leave_tls(tls_sock)
    return SealedSocket(sock, c2s, s2c)


def server_upgrade(tls_sock, request: bytes) -> SealedSocket:  # noqa: ANN001 - ssl.SSLSocket
    """The daemon's side, once it read the client's request after ``UPGRADE`` (the suite and the
    random bytes)."""
    if len(request) != REQUEST_BYTES - len(UPGRADE) or request[0] not in SUITES:
        raise ConnectionError("malformed sealed-records request")
    suite = request[0] if available(request[0]) else GCM
    mine = os.urandom(RANDOM_BYTES)
    tls_sock.sendall(UPGRADE + bytes((suite,)) + mine)
    c2s, s2c = _keys(bytes(request[1:]), mine, suite)
    sock = _leave_tls(tls_sock)
    return SealedSocket(sock, s2c, c2s)
