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
allocation beyond what the daemon stores.

A WRITE only lands payload bytes (DRAM: into the extent, after clearing its header; SSD: a
pending block); the block is stored only when the metadata service commits the put. A READ is
served only from a committed block of the named key and generation.
"""

from __future__ import annotations

import logging
import mmap
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from kvstore import tickets
from kvstore.daemon.arena import ShmArena
from kvstore.daemon.ssd import SsdSegment
from kvstore.daemon.staging import Staging
from kvstore.extent import HEADER_SIZE, SSD_ALIGN, ExtentHeader, Sealer, checksum
from kvstore.transport import native
from kvstore.transport.frames import (
    DIRECT,
    ENTRY,
    MAGIC,
    MAX_IOV,
    REQ_HEAD,
    RESP_HEAD,
    STAGED,
    STAGED_AT,
    EntryStatus,
    FrameError,
    FrameStatus,
    Op,
    TicketError,
    check_head,
    kernel_timeouts,
    recv_bytes,
    recv_exact,
    send_vec,
)
from kvstore.transport.sealed import REQUEST_BYTES, UPGRADE, server_upgrade

log = logging.getLogger("kvstore.daemon.dataport")

# SSD reads a connection keeps submitted (the one it waits for included), and the daemon's I/O
# threads that run them (for all connections): so a get split over two connections keeps
# IO_WORKERS direct reads in flight, with one read per connection queued behind them, so that a
# worker that finishes a read (and its checksum) starts the next at once, and a request's last
# block does not leave the disk with half the reads in flight while the next request starts.
READ_AHEAD = 3
IO_WORKERS = 4
_STATUS = {int(st): bytes((st,)) for st in EntryStatus}
# Tickets remembered as verified (DataPort), at most.
_VERIFIED_MAX = 1 << 16
# Bytes of block payloads gathered into one send on a read.
_GATHER_BYTES = 1 << 20
_READ_STATUS = {"checksum": EntryStatus.CHECKSUM, "io": EntryStatus.IO_ERROR}
# Whether the native module serves reads (kvstore/transport/serve.c; an older build may not).
_SERVES = native.impl is not None and hasattr(native.impl, "check_reads") and hasattr(native.impl, "serve_reads")


def check_entries(
    entries: list[tuple],
    op: int,
    segments: dict,
    max_block_bytes: int,
    ticket_key: bytes | Callable[[int, int], bytes],
    skew_s: float,
    verified: dict | None = None,
) -> list:
    """The segments (anything with a ``size``) that a frame's entries name, once every entry is
    checked: a known segment, an extent inside it, a length within ``max_block_bytes``, and
    (given a ``ticket_key``, or a function of (segment id, offset) giving the key of that extent's
    metadata shard) a capability ticket for exactly this entry. Pure but for ``verified``: the
    frame parser that the property tests and the atheris harness drive. Raises FrameError.

    ``verified`` (optional) remembers tickets whose MAC matched, with everything the MAC covers
    and the key that checked it, so that a ticket used again (a client re-reading a block it
    knows) costs a lookup instead of a keyed hash; its expiry is checked every time. Bounded by
    ``_VERIFIED_MAX`` entries (cleared when full)."""
    arenas = []
    signed = bool(ticket_key) and op in (Op.READ, Op.WRITE)
    top = tickets.READ if op == Op.READ else tickets.WRITE
    for i, (key, seg_id, expiry, off, length, _c, gen, tag) in enumerate(entries):
        arena = segments.get(seg_id)
        if arena is None:
            raise FrameError(f"entry {i}: unknown segment {seg_id}")
        if length <= 0 or off < 0 or off + HEADER_SIZE + length > arena.size:
            raise FrameError(
                f"entry {i}: extent offset {off} length {length} is outside segment {seg_id} of {arena.size} bytes"
            )
        if length > max_block_bytes:
            raise FrameError(f"entry {i}: length {length} is over the block limit of {max_block_bytes} bytes")
        if signed:
            k = ticket_key(seg_id, off) if callable(ticket_key) else ticket_key
            if not k:
                raise TicketError(f"entry {i}: no metadata shard has handed out extent {off} of segment {seg_id}")
            signed_entry = (k, top, seg_id, off, length, gen, expiry, key, tag)
            if verified is not None and signed_entry in verified:
                if expiry + skew_s < time.time():
                    raise TicketError(f"entry {i}: ticket expired")
            else:
                why = tickets.check(k, top, seg_id, off, length, gen, expiry, key, tag, skew_s)
                if why:
                    raise TicketError(f"entry {i}: {why}")
                if verified is not None:
                    if len(verified) >= _VERIFIED_MAX:
                        verified.clear()
                    verified[signed_entry] = True
        arenas.append(arena)
    return arenas


def _ssd_ref(entry: tuple) -> tuple[int, bytes, int, int]:
    key, _s, _e, off, length, _c, gen, _t = entry
    return off, key, length, gen


class DataPort:
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
        self._sock = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.counters = {
            "reads": 0, "read_bytes": 0, "writes": 0, "write_bytes": 0, "bad_frames": 0,
            "refused_connections": 0, "idle_closed": 0, "tls_refused": 0, "ticket_refused": 0,
            "staged": 0, "staged_bytes": 0,
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
            while first or recv_exact(conn, memoryview(head)):
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
            index = getattr(self._local, "slice", None)
            if index is not None and self.staging is not None:
                self._local.slice = None
                self.staging.give(index)

    def _check(self, entries: list[tuple], op: int) -> list:
        key = self.ticket_key if self.require_tickets else b""
        try:
            return check_entries(
                entries, op, self._segments(), self.max_block_bytes, key, self.ticket_skew_s, self._verified
            )
        except TicketError:
            self.counters["ticket_refused"] += 1
            raise

    def _native_plan(self, conn: socket.socket, op: int, raw: bytes) -> tuple[list[int], list] | None:
        """The DRAM segments a READ frame is served from natively (kvstore/transport/serve.c),
        when it can be: a plain socket, the native module built, one ticket key (or none
        required), and every entry naming a DRAM segment and passing what check_entries checks.
        None: the Python path (SSD entries, TLS and sealed channels, several ticket keys, or a
        frame it must refuse with the reason check_entries gives)."""
        impl = native.impl
        if op != Op.READ or not _SERVES or type(conn) is not socket.socket or conn.gettimeout() is not None:
            return None
        key = self._one_key()
        if key is None:
            return None
        ids, views, sizes = [], [], []
        for sid, seg in self._segments().items():
            if isinstance(seg, ShmArena):
                ids.append(sid)
                views.append(seg.view)
                sizes.append(seg.size)
        if not ids:
            return None
        try:
            bad = impl.check_reads(raw, ids, sizes, key, time.time(), self.ticket_skew_s, self.max_block_bytes)  # type: ignore[union-attr]
        except (ValueError, TypeError, OverflowError):  # settings the native check does not take
            return None
        return (ids, views) if bad < 0 else None

    def _one_key(self) -> bytes | None:
        """The one key every ticket is checked with (b"": none are), or None when that depends
        on the extent (several metadata shards) or no shard has given one yet."""
        if not self.require_tickets:
            return b""
        k = self.ticket_key
        if callable(k):
            one = self.one_ticket_key() if self.one_ticket_key is not None else None
            return one or None
        return k

    def _read(
        self,
        conn: socket.socket,
        op: int,
        req_id: int,
        entries: list[tuple],
        arenas: list,
        flags: int,
        raw: bytes = b"",
        plan: tuple[list[int], list] | None = None,
    ) -> None:
        n = len(entries) if plan is None else len(raw) // ENTRY.size
        if flags & DIRECT:
            if time.monotonic() > self.direct_until:
                # Without a lease, past a drain's grace (our blocks left the index): misses.
                conn.sendall(RESP_HEAD.pack(MAGIC, FrameStatus.OK, op, 0, req_id, n, 0))
                conn.sendall(bytes([EntryStatus.MISMATCH]) * n)
                return
            self.last_direct = time.monotonic()
        if plan is None:
            self._serve_read(conn, op, req_id, entries, arenas, flags)
        else:
            head = RESP_HEAD.pack(MAGIC, FrameStatus.OK, op, 0, req_id, n, 0)
            _ok, sent = native.impl.serve_reads(conn.fileno(), head, raw, plan[0], plan[1], self._sealer.secret)  # type: ignore[union-attr]
            self.counters["reads"] += n
            self.counters["read_bytes"] += sent
        if flags & DIRECT:
            self.last_direct = time.monotonic()

    def _serve_read(
        self, conn: socket.socket, op: int, req_id: int, entries: list[tuple], arenas: list, flags: int
    ) -> None:
        sent = 0
        # SSD blocks are read ahead on the I/O pool (direct reads, verified there) while earlier
        # ones are being sent: the disk and the socket work at the same time.
        ahead: dict[int, Future] = {}
        # Only committed blocks are read from SSD: the others are a miss before any buffer is sized.
        ssd_idx = [
            i for i, seg in enumerate(arenas) if isinstance(seg, SsdSegment) and seg.holds(*_ssd_ref(entries[i]))
        ]
        ssd_set = set(ssd_idx)
        # A same-host reader (STAGED) gets SSD blocks in the staging region, as many as fit.
        slots = self._slots(entries, arenas, ssd_idx) if flags & STAGED else {}
        msg = self.staging.message if slots else b""  # type: ignore[union-attr]
        conn.sendall(RESP_HEAD.pack(MAGIC, FrameStatus.OK, op, 0, req_id, len(entries), len(msg)) + msg)
        longest = max((entries[i][4] for i in ssd_idx if i not in slots), default=0)
        ring = self._ring(SsdSegment.staging_bytes(longest) if longest else 0, READ_AHEAD + 1)
        next_ssd = 0
        # Answers go out gathered, up to _GATHER_BYTES per system call: one sendmsg carries many
        # small blocks. Flushed before waiting on the disk, so the client is never kept waiting
        # for bytes that are ready, and before a read reuses a ring buffer whose block is still
        # among them (``unsent``: those ring buffers).
        out: list = []
        out_bytes = 0
        unsent: set[int] = set()
        in_ring: dict[int, int] = {}  # entry -> the ring buffer it is read into

        def submit_upto(limit: int) -> None:
            nonlocal next_ssd, out, out_bytes
            while next_ssd < len(ssd_idx) and next_ssd < limit:
                i = ssd_idx[next_ssd]
                key, _s, _e, off, length, _c, gen, _t = entries[i]
                staging = slots.get(i)
                if staging is None:
                    slot = next_ssd % len(ring)
                    if slot in unsent:
                        send_vec(conn, out)
                        out, out_bytes = [], 0
                        unsent.clear()
                    staging = ring[slot]
                    in_ring[i] = slot
                ahead[i] = self._io.submit(arenas[i].read, off, key, length, None, staging, gen)
                next_ssd += 1

        done_ssd = 0
        try:
            for i, ((key, _s, _e, off, length, _c, gen, _t), seg) in enumerate(zip(entries, arenas)):
                if isinstance(seg, SsdSegment) and i not in ssd_set:
                    status, payload = EntryStatus.MISMATCH, None
                elif isinstance(seg, SsdSegment):
                    submit_upto(done_ssd + READ_AHEAD)
                    fut = ahead.pop(i)
                    if out and not fut.done():
                        send_vec(conn, out)
                        out, out_bytes = [], 0
                        unsent.clear()
                    st, payload = fut.result()
                    done_ssd += 1
                    status = EntryStatus.OK if st.ok else _READ_STATUS.get(st.reason, EntryStatus.MISMATCH)
                else:
                    h = self._header(seg, off)
                    ok = h is not None and h.key == key and h.length == length and h.gen == gen
                    status = EntryStatus.OK if ok else EntryStatus.MISMATCH
                    payload = seg.view[off + HEADER_SIZE : off + HEADER_SIZE + length] if ok else None
                if status == EntryStatus.OK and i in slots and self._inside(payload, slots[i]):
                    out.append(STAGED_AT.pack(EntryStatus.STAGED, self.staging.offset_of(payload)))  # type: ignore[union-attr]
                    self.counters["staged"] += 1
                    self.counters["staged_bytes"] += length
                elif status == EntryStatus.OK:
                    out += (_STATUS[status], payload)
                    out_bytes += length
                    sent += length
                    if i in in_ring:
                        unsent.add(in_ring[i])
                else:
                    out.append(_STATUS[status])
                if out_bytes >= _GATHER_BYTES or len(out) >= MAX_IOV:
                    send_vec(conn, out)
                    out, out_bytes = [], 0
                    unsent.clear()
            if out:
                send_vec(conn, out)
        finally:
            # Reads still under way write into this connection's buffers (its staging slice,
            # which goes to another connection once this one closes): let them finish first.
            wait(ahead.values())
        self.counters["reads"] += len(entries)
        self.counters["read_bytes"] += sent

    def _header(self, seg: ShmArena, off: int) -> ExtentHeader | None:
        """The sealed header of the DRAM extent at ``off`` (None: none, or not sealed by this
        daemon for that offset). Headers this daemon sealed or checked before cost a lookup
        (:class:`Sealer` remembers them)."""
        return self._sealer.parse(seg.view[off : off + HEADER_SIZE], 0, at=off)

    def _slots(self, entries: list[tuple], arenas: list, ssd_idx: list[int]) -> dict[int, np.ndarray]:
        """Places in this connection's staging slice (the half whose turn it is) for the SSD
        entries that fit, in order."""
        if self.staging is None or not ssd_idx:
            return {}
        index = getattr(self._local, "slice", None)
        if index is None:
            index = self._local.slice = self.staging.take()
            if index is None:
                return {}
            self._local.half = 0
        # The connection's staged requests use the slice's two halves in turn: the client may
        # already have sent this request while it copies the last one's blocks (Staging).
        half = self._local.half
        self._local.half = half ^ 1
        region = self.staging.view(index, half)
        slots, pos = {}, 0
        for i in ssd_idx:
            _k, _s, _e, off, length, _c, _g, _t = entries[i]
            size = arenas[i].stage_bytes(off, length)
            size += -size % SSD_ALIGN
            if pos + size > region.size:
                break
            slots[i] = region[pos : pos + size]
            pos += size
        return slots

    @staticmethod
    def _inside(payload: np.ndarray, slot: np.ndarray) -> bool:
        start = payload.ctypes.data - slot.ctypes.data
        return 0 <= start and start + payload.size <= slot.size

    def _ring(self, size: int, depth: int) -> list[np.ndarray]:
        """Per-connection page-aligned staging buffers for direct reads, touched once, reused."""
        ring = getattr(self._local, "ring", None)
        if size and (ring is None or ring[0].size < size or len(ring) < depth):
            maps = [mmap.mmap(-1, size) for _ in range(depth)]
            ring = [np.frombuffer(m, np.uint8) for m in maps]
            for r in ring:
                r[:] = 1
            self._local.ring, self._local.maps = ring, maps
        return ring or []

    def _write(self, conn: socket.socket, op: int, req_id: int, entries: list[tuple], arenas: list) -> None:
        status = bytearray(len(entries))
        total = 0
        for i, ((key, _s, _e, off, length, csum, gen, _t), seg) in enumerate(zip(entries, arenas)):
            if self.require_tickets and self._sealed(seg, off, gen):
                # That generation is already committed there: a replayed write ticket must not
                # touch it (without tickets any peer may write anyway, so nothing is checked).
                if not recv_exact(conn, memoryview(self._staging(length))):
                    raise ConnectionError("peer closed mid-write")
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
            else:
                staging = self._staging(length)
                if not recv_exact(conn, memoryview(staging)):
                    raise ConnectionError("peer closed mid-write")
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
        conn.sendall(RESP_HEAD.pack(MAGIC, FrameStatus.OK, op, 0, req_id, len(entries), 0) + bytes(status))
        self.counters["writes"] += len(entries)
        self.counters["write_bytes"] += total

    def _sealed(self, seg: ShmArena | SsdSegment, off: int, gen: int) -> bool:
        if isinstance(seg, ShmArena):
            h = self._sealer.parse(seg.view, off)
            return h is not None and h.gen == gen
        return seg.committed_gen(off) == gen

    def _staging(self, size: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < size:
            buf = self._local.buf = np.ones(max(size, 4 << 20), np.uint8)
        return buf[:size]
