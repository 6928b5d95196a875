"""The daemon's data port: batched reads and writes of extents over framed TCP
(:mod:`kvstore.transport.frames`), straight between the socket and the arena.

One thread per connection with blocking sockets: ``recv_into`` the arena and ``sendmsg`` from
it (a read's answers gathered, up to a MiB of blocks per call) release the GIL, so the kernel
copy is the only copy. Frames are validated whole before any
byte is applied; a bad frame gets its reason back and the connection is closed.

Bounds, so that a peer cannot make the daemon hold threads or memory at will: at most
``max_connections`` connections are served at once (more are closed as they are accepted);
a connection idle, or stalled mid-frame, for ``idle_timeout_s`` is closed; no entry may carry
more than ``max_block_bytes``; an SSD read is served (and its staging buffer sized) only for a
committed block of that offset, key, length and generation, so a frame's lengths never size an
allocation beyond what the daemon stores; a head's entry count sizes nothing before the entries
arrive (:func:`~kvstore.transport.frames.recv_bytes` grows as bytes come).

A WRITE only lands payload bytes (DRAM: into the extent, after clearing its header; SSD: a
pending block); the block is stored only when the metadata service commits the put. With
tickets, a WRITE entry is refused (MISMATCH, its payload drained) when its extent already holds a
committed block of the ticket's generation or a later one: the service's generations only
increase, so that is a replayed ticket, or one that outlived its reservation while the extent
went to a later put. A READ is served only from a committed block of the named key and generation.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore import tickets
from kvstore.daemon.arena import ShmArena
from kvstore.daemon.entries import check_entries
from kvstore.daemon.reads import IO_WORKERS, NextRead, ReadServing
from kvstore.daemon.ssd import SsdSegment
from kvstore.daemon.staging import Staging
from kvstore.extent import HEADER_SIZE, Sealer, checksum
from kvstore.transport.frames import (
    ENTRY,
    MAGIC,
    REQ_HEAD,
    RESP_HEAD,
    EntryStatus,
    FrameError,
    FrameStatus,
    Op,
    TicketError,
    check_head,
    kernel_timeouts,
    recv_bytes,
    recv_exact,
)
from kvstore.transport.sealed import REQUEST_BYTES, UPGRADE, server_upgrade

log = logging.getLogger("kvstore.daemon.dataport")

_STAGING_MIN = 4 << 20  # a connection's staging buffer for SSD writes, at least


class DataPort(ReadServing):
    """Serves the segments returned by ``segments()`` (segment_id -> arena) on a TCP port."""

    def __init__(
        self,
        host: str,
        port: int,
        segments: Callable[[], dict],
        sealer: Sealer,
        max_connections: int = 512,
        idle_timeout_s: float = 300.0,
        max_block_bytes: int = 1 << 30,
        ssl_context: ssl.SSLContext | None = None,
        ticket_key: bytes = b"",
        ticket_skew_s: float = tickets.SKEW_S,
        staging: Staging | None = None,
        one_ticket_key: Callable[[], bytes | None] | None = None,
    ) -> None:
        self._segments = segments
        # Capability tickets (kvstore.tickets): required from the start when there is a key;
        # the daemon turns them off only if the service it registers with signs none.
        self.ticket_key = ticket_key
        self.require_tickets = bool(ticket_key)
        # With a ticket_key function (one key per metadata shard): the key of every extent when
        # there is one, else None (kvstore.transport.serve.c checks a frame under one key).
        self.one_ticket_key = one_ticket_key
        self.ticket_skew_s = ticket_skew_s
        self._ssl = ssl_context  # mutual TLS (kvstore.tls): a client certificate is required
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.max_block_bytes = max_block_bytes
        self._sealer = sealer
        self._verified: dict = {}  # tickets whose MAC matched (check_entries)
        # Spent write tickets: once a block written with a ticket is committed (spend()), that
        # ticket (its generation) writes nothing more for as long as it could be honoured. The
        # block may be removed or evicted meanwhile and its bytes given to another block, at the
        # same offset or overlapping it, which a late or replayed write must not reach.
        self._ticketed: dict[int, float] = {}  # generation -> honoured until (wall clock): written
        self._spent: dict[int, float] = {}  # generation -> honoured until: written and committed
        self._spent_lock = threading.Lock()
        self._sock = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.counters = {
            "reads": 0, "read_bytes": 0, "writes": 0, "write_bytes": 0, "bad_frames": 0,
            "refused_connections": 0, "idle_closed": 0, "tls_refused": 0, "ticket_refused": 0,
            "staged": 0, "staged_bytes": 0, "read_ahead_requests": 0,
        }  # fmt: skip
        self.active = 0  # requests being served (a drain waits for 0)
        # Reads without a lease (frames.DIRECT) are served until this monotonic time (a drain
        # sets it); after it they are misses. last_direct: when one was last served.
        self.direct_until = float("inf")
        self.last_direct = 0.0
        self.staging = staging  # where same-host readers get SSD blocks (frames.STAGED)
        self._local = threading.local()
        self._io = ThreadPoolExecutor(max_workers=IO_WORKERS, thread_name_prefix="dataport-io")
        self._thread = threading.Thread(target=self._accept_loop, name="dataport-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self.counters["refused_connections"] += 1
                log.warning("event=connection_refused reason=limit limit=%d", self.max_connections)
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # The idle / stall bound as kernel timeouts on a blocking socket (TLS connections
            # get a Python-level one until they leave TLS, see _serve).
            kernel_timeouts(conn, self.idle_timeout_s)
            threading.Thread(target=self._serve, args=(conn,), name="dataport-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(REQ_HEAD.size)
        try:
            if self._ssl is not None:
                raw = conn
                # TLS gets the idle bound as a Python-level timeout (see frames.kernel_timeouts):
                # a stalled peer would otherwise hold its connection slot for ever.
                raw.settimeout(self.idle_timeout_s)
                try:
                    conn = self._ssl.wrap_socket(raw, server_side=True)  # the handshake, under the idle timeout
                except (OSError, ValueError) as e:
                    self.counters["tls_refused"] += 1
                    log.info("event=tls_refused reason=%r", str(e))
                    conn = raw
                    return
                with self._lock:
                    self._conns.discard(raw)
                    self._conns.add(conn)
            # The first bytes: a frame's head, or (TLS only) a request for sealed records.
            if not recv_exact(conn, memoryview(head)[: len(UPGRADE)]):
                return
            if self._ssl is not None and head[: len(UPGRADE)] == UPGRADE:
                request = recv_bytes(conn, REQUEST_BYTES - len(UPGRADE))
                if request is None:
                    return
                tls_conn = conn
                conn = server_upgrade(tls_conn, request)
                with self._lock:
                    self._conns.discard(tls_conn)
                    self._conns.add(conn)  # type: ignore[arg-type]
                first = recv_exact(conn, memoryview(head))
            elif recv_exact(conn, memoryview(head)[len(UPGRADE) :]):
                first = True
            else:
                return
            while True:
                taken: NextRead | None = getattr(self._local, "next", None)
                if taken is not None:  # checked, begun and counted active while the last was served
                    self._local.next = None
                    try:
                        self._read(conn, Op.READ, taken.req_id, taken.entries, taken.arenas, taken.flags, taken=taken)
                    finally:
                        self._end_taken(taken)  # also when the request ended early
                    continue
                if not (first or recv_exact(conn, memoryview(head))):
                    break
                first = False
                op, req_id = head[5], REQ_HEAD.unpack(head)[4]
                try:
                    op, req_id, count = check_head(bytes(head))
                    flags = int.from_bytes(head[6:8], "little")
                    raw = recv_bytes(conn, count * ENTRY.size) if count else b""
                    if raw is None:
                        return
                    plan = self._native_plan(conn, op, raw) if count else None
                    if plan is None:
                        entries = list(ENTRY.iter_unpack(raw)) if count else []
                        arenas = self._check(entries, op)
                    else:
                        entries, arenas = [], []
                except FrameError as e:
                    self.counters["bad_frames"] += 1
                    log.info("event=bad_frame reason=%r", str(e))
                    msg = str(e).encode()[:4096]
                    conn.sendall(RESP_HEAD.pack(MAGIC, FrameStatus.BAD_FRAME, op & 0xFF, 0, req_id, 0, len(msg)) + msg)
                    return
                with self._lock:
                    self.active += 1
                try:
                    if op == Op.READ:
                        self._read(conn, op, req_id, entries, arenas, flags, raw, plan)
                    elif op == Op.WRITE:
                        self._write(conn, op, req_id, entries, arenas)
                    else:
                        conn.sendall(RESP_HEAD.pack(MAGIC, FrameStatus.OK, op, 0, req_id, 0, 0))
                finally:
                    with self._lock:
                        self.active -= 1
        except (TimeoutError, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            self.counters["idle_closed"] += 1  # SO_RCVTIMEO / SO_SNDTIMEO passed
        except (ConnectionError, OSError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            taken = getattr(self._local, "next", None)
            if taken is not None:  # taken ahead, never served
                self._local.next = None
                self._end_taken(taken)
            index = getattr(self._local, "slice", None)
            if index is not None and self.staging is not None:
                self._local.slice = None
                self.staging.give(index)

    def _check(self, entries: list[tuple], op: int, count: bool = True) -> list:
        key = self.ticket_key if self.require_tickets else b""
        try:
            return check_entries(
                entries, op, self._segments(), self.max_block_bytes, key, self.ticket_skew_s, self._verified
            )
        except TicketError:
            if count:
                self.counters["ticket_refused"] += 1
            raise

    def _write(self, conn: socket.socket, op: int, req_id: int, entries: list[tuple], arenas: list) -> None:
        status = bytearray(len(entries))
        total = 0
        for i, ((key, _s, expiry, off, length, csum, gen, _t), seg) in enumerate(zip(entries, arenas)):
            if self.require_tickets and (gen in self._spent or self._sealed_since(seg, off, gen)):
                # That generation, or a later one, is committed there: a write ticket replayed
                # after its commit, or outliving its reservation (aborted or expired, the extent
                # since given to a later put), must not touch it. Generations only increase.
                # (Without tickets any peer may write anyway, so nothing is checked.)
                self._drain(conn, length)
                status[i] = EntryStatus.MISMATCH
                continue
            if isinstance(seg, ShmArena):
                seg.clear_header(off)
                payload = seg.view[off + HEADER_SIZE : off + HEADER_SIZE + length]
                if not recv_exact(conn, payload):
                    raise ConnectionError("peer closed mid-write")
                if checksum(payload) != csum:
                    status[i] = EntryStatus.CHECKSUM
                    continue
                if self._sealed_since(seg, off, gen):
                    # Committed meanwhile (this placement's block, by a write of it that ended
                    # first, or a later one): a stamp would overwrite the front of its sealed header.
                    status[i] = EntryStatus.MISMATCH
                    continue
                seg.stamp_written(off, gen)  # whole and as announced: its commit may seal it
            else:
                staging = self._receive_staged(conn, length)
                if checksum(staging) != csum:
                    status[i] = EntryStatus.CHECKSUM
                    continue
                try:
                    seg.write(off, key, staging, csum, gen)
                except (OSError, ValueError) as e:
                    log.warning("event=ssd_write_failed key=%s reason=%r", key.hex(), str(e))
                    status[i] = EntryStatus.IO_ERROR
                    continue
            total += length
            if self.require_tickets:
                with self._spent_lock:
                    self._ticketed[gen] = expiry + self.ticket_skew_s
        conn.sendall(RESP_HEAD.pack(MAGIC, FrameStatus.OK, op, 0, req_id, len(entries), 0) + bytes(status))
        self.counters["writes"] += len(entries)
        self.counters["write_bytes"] += total

    def spend(self, gen: int) -> None:
        """The block of generation ``gen`` was committed: its write ticket, if one wrote it, is
        spent (see ``_spent``)."""
        now = time.time()
        with self._spent_lock:
            until = self._ticketed.pop(gen, None)
            if until is not None and until > now:
                self._spent[gen] = until
            for d in (self._ticketed, self._spent):  # oldest first, about: ends are near in order
                while d:
                    old, t = next(iter(d.items()))
                    if t > now:
                        break
                    del d[old]

    def _sealed_since(self, seg: ShmArena | SsdSegment, off: int, gen: int) -> bool:
        """Whether the extent at ``off`` holds a committed block of generation ``gen`` or later."""
        if isinstance(seg, ShmArena):
            h = self._header(seg, off)
            return h is not None and h.gen >= gen
        committed = seg.committed_gen(off)  # None: nothing committed there
        return committed is not None and committed >= gen

    def _drain(self, conn: socket.socket, length: int) -> None:
        """Receives and drops a refused entry's ``length`` payload bytes, through at most the
        staging buffer's least size at a time."""
        buf = memoryview(self._staging(min(length, _STAGING_MIN)))
        while length > 0:
            n = min(length, len(buf))
            if not recv_exact(conn, buf[:n]):
                raise ConnectionError("peer closed mid-write")
            length -= n

    def _receive_staged(self, conn: socket.socket, length: int) -> np.ndarray:
        """An SSD write's ``length`` payload bytes, in this thread's staging buffer, which grows
        only as bytes arrive (at most doubling what arrived): without tickets ``length`` is
        the peer's word alone, and a peer that announces a large block and sends little holds
        no more memory than it sent."""
        at = 0
        self._staging(min(length, _STAGING_MIN))
        buf = self._local.buf  # whole: it may be larger from an earlier write
        while at < length:
            upto = min(length, max(_STAGING_MIN, 2 * at))
            if buf.size < upto:
                grown = np.empty(upto, np.uint8)
                grown[:at] = buf[:at]
                self._local.buf = buf = grown
            if not recv_exact(conn, memoryview(buf)[at:upto]):
                raise ConnectionError("peer closed mid-write")
            at = upto
        return buf[:length]

    def _staging(self, size: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < size:
            buf = self._local.buf = np.ones(max(size, _STAGING_MIN), np.uint8)
        return buf[:size]
