"""The data port's framed TCP protocol, shared by the daemon and the client.

A request is a head, ``count`` entries, then (WRITE only) the payloads in entry order::

    head  = magic "KVD1" | version u8 | op u8 | flags u16 | request_id u64 | count u32     (20 B)
    entry = key 16s | segment_id u32 | expiry u32 | offset u64 | length u64 | checksum u64 | gen u64
            | mac 16s                                                                       (72 B)

A WRITE response is a head, a message (non-empty only on a frame error), then one status byte
per entry. A READ response is a head, a message, then per entry in order its status byte,
followed by its payload when the status is OK (so the daemon can stream from SSD)::

    head  = magic "KVD1" | status u8 | op u8 | flags u16 | request_id u64 | count u32 | msg_len u32 (24 B)

A frame error (bad magic, version, op, count, range) is answered with its message and the
connection is closed: nothing of that request was applied. ``offset`` is the extent's start
(its header); payload bytes live at ``offset + 64``. ``gen`` is the placement's generation: a
READ is served only if the extent holds that generation of the key; a WRITE lands as a pending
block of that generation, which only the metadata service's commit makes a stored one.
A READ head may carry the flag ``STAGED`` (the reader is on the daemon's host and maps its
staging region, :mod:`kvstore.daemon.staging`): SSD entries may then be answered with status
``STAGED`` and the u64 offset of their verified payload in that region instead of the payload;
the response head's message names the region ("path\nsize\nslice bytes\ninode"). A READ head may carry the flag ``DIRECT``: the reader holds no lease, it reads from a location
it learned earlier (:mod:`kvstore.client.locations`); a draining daemon, whose blocks have left
the index, serves them only through ``daemon.drain_direct_grace_s`` (so that gets under way
complete) and answers them as a mismatch (a miss) after it, serving only leased reads.
``expiry`` and ``mac`` are the entry's capability ticket from the metadata service
(:mod:`kvstore.tickets`); a daemon that requires tickets refuses the frame when one does not
match what its entry names, or has expired.
"""

from __future__ import annotations

import socket
import struct
import time
from enum import IntEnum

MAGIC = b"KVD1"
VERSION = 3
REQ_HEAD = struct.Struct("<4sBBHQI")
ENTRY = struct.Struct("<16sIIQQQQ16s")
RESP_HEAD = struct.Struct("<4sBBHQII")
MAX_ENTRIES = 65536
DIRECT = 1  # head flag of a READ without a lease
STAGED = 2  # head flag of a READ from the daemon's host: SSD blocks may come staged in shared memory
STAGED_AT = struct.Struct("<BQ")  # a staged entry: status STAGED | offset in the staging region
MAX_MESSAGE = 4096


class FrameError(Exception):
    """A frame the daemon refuses whole (answered with its message; the connection closes)."""


class TicketError(FrameError):
    """An entry whose capability ticket does not allow it."""


class Op(IntEnum):
    READ = 1
    WRITE = 2
    PING = 3


class FrameStatus(IntEnum):
    OK = 0
    BAD_FRAME = 1


class EntryStatus(IntEnum):
    OK = 0
    MISMATCH = 1  # the extent no longer holds this key (evicted, overwritten)
    CHECKSUM = 2  # bytes do not match their checksum (written: as sent; read: as stored)
    IO_ERROR = 3
    STAGED = 4  # read and verified into the staging region: its offset follows, not its bytes


def check_head(head: bytes) -> tuple[int, int, int]:
    """A request head's (op, request_id, count), checked before anything else is read."""
    if len(head) != REQ_HEAD.size:
        raise FrameError(f"a request head is {REQ_HEAD.size} bytes, got {len(head)}")
    magic, version, op, _flags, req_id, count = REQ_HEAD.unpack(head)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FrameError(f"unsupported protocol version {version}, expected {VERSION}")
    if op not in (Op.READ, Op.WRITE, Op.PING):
        raise FrameError(f"unknown op {op}")
    if count > MAX_ENTRIES:
        raise FrameError(f"{count} entries is over the limit of {MAX_ENTRIES}")
    return op, req_id, count


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Makes ``sock`` blocking, with ``seconds`` as its kernel receive and send timeouts
    (SO_RCVTIMEO / SO_SNDTIMEO): a Python-level timeout makes a socket non-blocking, with a poll()
    before every recv and send and each recv returning whatever has arrived so far. Not for TLS
    sockets: on a blocking socket the ssl module retries a read that a kernel timeout ended."""
    sock.settimeout(None)
    usec = max(1, round(seconds * 1e6))  # a zero timeval would mean no timeout at all
    tv = struct.pack("ll", usec // 1_000_000, usec % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


# The most buffers one sendmsg takes (Linux' UIO_MAXIOV is 1024).
MAX_IOV = 512


def send_vec(sock: socket.socket, parts: list) -> None:  # noqa: ANN001 - buffers
    """Sends ``parts`` (buffers) in order, as few system calls as the socket allows: gathered
    by ``sendmsg`` on a plain socket (continuing where a partial send stopped), one after the
    other on TLS and sealed channels."""
    if type(sock) is not socket.socket:
        for part in parts:
            sock.sendall(part)
        return
    views = [memoryview(p).cast("B") for p in parts]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + MAX_IOV])
        while i < len(views) and sent >= len(views[i]):
            sent -= len(views[i])
            i += 1
        if sent:
            views[i] = views[i][sent:]


# A read that has waited out its socket's timeout must have averaged at least this many bytes a
# second since its first short answer, or the peer is taken to have stalled mid-frame: a timeout
# bounds one wait for bytes, and a peer trickling a byte within each wait could otherwise drag
# one frame out for ever. This bounds how long one read can be dragged out (about twice the
# timeout, at a trickle), not how long a peer holds its connection: one that sends a whole small
# frame within every timeout holds it, as any keep-alive peer does (the connection limit, tickets
# and mutual TLS are what bound those). Far below what any peer of a KV-cache tier sends (a
# network link gives hundreds of MB/s).
MIN_RATE = 1 << 20


def wait_bound(sock) -> float | None:  # noqa: ANN001 - a socket, or one of the socket-likes
    """How long one wait for bytes on ``sock`` may last: its Python-level timeout, else (a plain
    socket) its kernel receive timeout; None if unbounded."""
    get = getattr(sock, "gettimeout", None)
    t = get() if get is not None else None
    if t is not None or type(sock) is not socket.socket:
        return t
    try:
        sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
    except OSError:
        return None
    return sec + usec / 1e6 or None


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fills ``view`` from the socket. False if the peer closed before the first byte.

    Raises TimeoutError when the peer stalls mid-read: a wait for bytes ended by the socket's
    timeout with the read averaging under ``MIN_RATE`` since it began (a trickle of bytes, each
    within the timeout, is a stall too)."""
    n = len(view)
    pos = 0
    # A plain blocking socket fills the whole view in one call (TLS and sealed channels take no flags).
    waitall = type(sock) is socket.socket and sock.gettimeout() is None
    start = 0.0
    first = 0
    while pos < n:
        got = (
            sock.recv_into(view[pos:], n - pos, socket.MSG_WAITALL) if waitall else sock.recv_into(view[pos:], n - pos)
        )
        if got == 0:
            if pos == 0:
                return False
            raise ConnectionError(f"peer closed after {pos} of {n} bytes")
        pos += got
        if pos < n:  # short: with waitall only when the timeout ended the wait (or a signal)
            now = time.monotonic()
            if not start:
                start = now  # the first short answer starts the clock: a read begins with a wait
                first = got
                continue
            limit = wait_bound(sock)
            elapsed = now - start
            if limit is not None and elapsed >= limit and pos - first < MIN_RATE * elapsed:
                raise TimeoutError(f"peer stalled mid-read: {pos} of {n} bytes after {elapsed:.1f} s")
    return True


# What recv_bytes sets aside before any of a longer run of bytes has arrived.
RECV_CHUNK = 64 << 10


def recv_bytes(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from the socket; None if the peer closed before the first. ``n`` often comes
    from the peer (a head's entry count, a message length), so the buffer grows only as bytes
    arrive: up to ``RECV_CHUNK`` at first, then at most what has arrived again (a peer that
    announces much and sends little holds no more than that). A run of ``RECV_CHUNK`` or fewer
    is one ``recv_exact``."""
    if n <= RECV_CHUNK:
        buf = bytearray(n)
        if n and not recv_exact(sock, memoryview(buf)):
            return None
        return bytes(buf)
    buf = bytearray()
    while len(buf) < n:
        at = len(buf)
        buf.extend(bytes(min(n - at, max(RECV_CHUNK, at))))
        if not recv_exact(sock, memoryview(buf)[at:]):
            if at == 0:
                return None
            raise ConnectionError(f"peer closed after {at} of {n} bytes")
    return bytes(buf)
