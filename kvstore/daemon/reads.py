"""How the data port serves a READ (:class:`ReadServing`, a part of
:class:`kvstore.daemon.dataport.DataPort`): DRAM blocks natively when it can
(kvstore/transport/serve.c), else gathered from the arena; SSD blocks with direct reads on the
I/O threads, read ahead of the one being sent, into a per-connection ring (streamed) or into the
connection's staging slice (same-host readers, kvstore.daemon.staging); and, for a staged
reader, the next request's reads begun while this one's last blocks are read."""

from __future__ import annotations

import mmap
import socket
import time
from concurrent.futures import Future, wait

import numpy as np

from kvstore.daemon.arena import ShmArena
from kvstore.daemon.ssd import SsdSegment
from kvstore.extent import HEADER_SIZE, SSD_ALIGN, ExtentHeader
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
    check_head,
    recv_exact,
    send_vec,
)

# SSD reads a connection keeps submitted (the one it waits for included), and the daemon's I/O
# threads that run them (for all connections): a get split over two connections keeps up to
# IO_WORKERS direct reads in flight, with reads queued behind them, so that a worker that finishes
# a read (and its checksum) starts the next at once. For a staged reader the count runs across
# requests (NextRead): the next request's reads start while this one's last are in flight.
READ_AHEAD = 3
IO_WORKERS = 4
_STATUS = {int(st): bytes((st,)) for st in EntryStatus}
# Bytes of block payloads gathered into one send on a read.
_GATHER_BYTES = 1 << 20
_READ_STATUS = {"checksum": EntryStatus.CHECKSUM, "io": EntryStatus.IO_ERROR}
# Whether the native module serves reads (kvstore/transport/serve.c; an older build may not).
_SERVES = native.impl is not None and hasattr(native.impl, "check_reads") and hasattr(native.impl, "serve_reads")


class NextRead:
    """A staged READ taken off the socket while the request before it is still being served,
    checked as any frame, with the first of its SSD reads already submitted
    (:meth:`ReadServing._take_next`): the disk goes on to it while the last request's last blocks
    are read, instead of running with fewer reads in flight at the end of every request."""

    __slots__ = ("req_id", "flags", "entries", "arenas", "ssd_idx", "slots", "ahead", "submitted")

    def __init__(self, req_id: int, flags: int, entries: list, arenas: list, ssd_idx: list[int], slots: dict) -> None:
        self.req_id, self.flags, self.entries, self.arenas = req_id, flags, entries, arenas
        self.ssd_idx, self.slots = ssd_idx, slots
        self.ahead: dict[int, Future] = {}
        self.submitted = 0  # how many of ssd_idx have their read submitted

    def pending(self) -> int:
        return sum(not f.done() for f in self.ahead.values())


# A request is taken ahead of its turn only if its entries are at most this many (a frame that is
# all in the socket's buffer already; larger ones are read when their turn comes).
_NEXT_MAX_ENTRIES = 4096


def _committed_ssd(entries: list[tuple], arenas: list) -> list[int]:
    """The entries naming a block committed on an SSD segment, the only ones read from SSD: the
    others are a miss before any buffer is sized."""
    out = []
    for i, seg in enumerate(arenas):
        if isinstance(seg, SsdSegment):
            key, _s, _e, off, length, _c, gen, _t = entries[i]
            if seg.holds(off, key, length, gen):
                out.append(i)
    return out


class ReadServing:
    """The READ half of the data port (its attributes are the DataPort's)."""

    def _take_next(self, conn: socket.socket) -> NextRead | None:
        """The next request, taken off the socket ahead of its turn, when it is a staged READ
        of SSD blocks (same-host, lease-held) that is all in the socket's buffer already and
        passes every check; else None, and the request is read in its turn as any other (a
        frame to refuse is refused then, with its reason). Its staged blocks go into the staging
        half that is its turn, which its client no longer reads: it sent this request only once
        it had copied every answer but the last one's (kvstore.daemon.staging)."""
        if type(conn) is not socket.socket or self.staging is None:
            return None
        try:
            head = conn.recv(REQ_HEAD.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            if len(head) < REQ_HEAD.size:
                return None  # not there yet: asked again at the next block
            self._local.next_seen = True  # there: whatever it is, asked once per request
            op, req_id, count = check_head(head)
            flags = int.from_bytes(head[6:8], "little")
            if op != Op.READ or not flags & STAGED or flags & DIRECT or not 0 < count <= _NEXT_MAX_ENTRIES:
                return None
            size = REQ_HEAD.size + count * ENTRY.size
            frame = conn.recv(size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            if len(frame) < size:
                self._local.next_seen = False  # the rest of it may come: asked again
                return None
            entries = list(ENTRY.iter_unpack(memoryview(frame)[REQ_HEAD.size :]))
            arenas = self._check(entries, op, count=False)
            ssd_idx = _committed_ssd(entries, arenas)
            if not ssd_idx:
                return None
            # What was peeked is there: taken off the socket. (A connection that fails here
            # fails the request being served, as its own send would.)
            if not recv_exact(conn, memoryview(bytearray(size))):
                return None
        except (BlockingIOError, InterruptedError, FrameError):
            return None
        taken = NextRead(req_id, flags, entries, arenas, ssd_idx, self._slots(entries, arenas, ssd_idx))
        self.counters["read_ahead_requests"] += 1
        with self._lock:
            self.active += 1  # being served from now (a drain waits for it), until its answer is sent
        return taken

    def _read_next(self, conn: socket.socket, inflight: int) -> None:
        """Submits the next request's first staged reads (taking it first, see _take_next) while
        this request has fewer than READ_AHEAD of its own in flight and nothing left to submit."""
        taken = getattr(self._local, "next", None)
        if taken is None:
            if getattr(self._local, "next_seen", False):
                return  # looked at once for this request, and not one to take ahead
            taken = self._local.next = self._take_next(conn)
            if taken is None:
                return
        budget = READ_AHEAD - inflight - taken.pending()
        while budget > 0 and taken.submitted < len(taken.ssd_idx):
            i = taken.ssd_idx[taken.submitted]
            staging = taken.slots.get(i)
            if staging is None:  # past what was staged: read in its turn, into the ring
                break
            taken.ahead[i] = self._submit_read(taken.entries[i], taken.arenas[i], staging)
            taken.submitted += 1
            budget -= 1

    def _submit_read(self, entry: tuple, ssd: SsdSegment, into: np.ndarray) -> Future:
        """One SSD block's direct read (verified there) on the I/O threads, into ``into``."""
        key, _s, _e, off, length, _c, gen, _t = entry
        return self._io.submit(ssd.read, off, key, length, None, into, gen)

    def _end_taken(self, taken: NextRead) -> None:
        """A request taken ahead is over (answered, or its connection ended): its reads, which
        write into this connection's staging slice, have ended before the slice can be given
        back, and it no longer counts as active."""
        wait(taken.ahead.values())
        with self._lock:
            self.active -= 1

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
        taken: NextRead | None = None,
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
            self._serve_read(conn, op, req_id, entries, arenas, flags, taken)
        else:
            head = RESP_HEAD.pack(MAGIC, FrameStatus.OK, op, 0, req_id, n, 0)
            _ok, sent = native.impl.serve_reads(conn.fileno(), head, raw, plan[0], plan[1], self._sealer.secret)  # type: ignore[union-attr]
            self.counters["reads"] += n
            self.counters["read_bytes"] += sent
        if flags & DIRECT:
            self.last_direct = time.monotonic()

    def _serve_read(
        self,
        conn: socket.socket,
        op: int,
        req_id: int,
        entries: list[tuple],
        arenas: list,
        flags: int,
        taken: NextRead | None = None,
    ) -> None:
        sent = 0
        # SSD blocks are read ahead on the I/O pool (direct reads, verified there) while earlier
        # ones are being sent: the disk and the socket work at the same time.
        ahead: dict[int, Future] = {}
        self._local.next_seen = False  # the next request is yet to be looked at (_take_next)
        if taken is not None:  # begun while the request before it was served
            ssd_idx, slots, ahead = taken.ssd_idx, taken.slots, taken.ahead
        else:
            ssd_idx = _committed_ssd(entries, arenas)
            # A same-host reader (STAGED) gets SSD blocks in the staging region, as many as fit.
            slots = self._slots(entries, arenas, ssd_idx) if flags & STAGED else {}
        ssd_set = set(ssd_idx)
        msg = self.staging.message if slots else b""  # type: ignore[union-attr]
        conn.sendall(RESP_HEAD.pack(MAGIC, FrameStatus.OK, op, 0, req_id, len(entries), len(msg)) + msg)
        longest = max((entries[i][4] for i in ssd_idx if i not in slots), default=0)
        ring = self._ring(SsdSegment.staging_bytes(longest) if longest else 0, READ_AHEAD + 1)
        next_ssd = taken.submitted if taken is not None else 0
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
                staging = slots.get(i)
                if staging is None:
                    slot = next_ssd % len(ring)
                    if slot in unsent:
                        send_vec(conn, out)
                        out, out_bytes = [], 0
                        unsent.clear()
                    staging = ring[slot]
                    in_ring[i] = slot
                ahead[i] = self._submit_read(entries[i], arenas[i], staging)
                next_ssd += 1

        done_ssd = 0
        try:
            for i, ((key, _s, _e, off, length, _c, gen, _t), seg) in enumerate(zip(entries, arenas)):
                if isinstance(seg, SsdSegment) and i not in ssd_set:
                    status, payload = EntryStatus.MISMATCH, None
                elif isinstance(seg, SsdSegment):
                    submit_upto(done_ssd + READ_AHEAD)
                    # Left in ``ahead`` until it has ended: whatever raises meanwhile (a send to
                    # a peer that went away), the finally below waits for it, and the staging
                    # slice it writes into is not given to another connection before it ends.
                    fut = ahead[i]
                    if next_ssd == len(ssd_idx) and slots:
                        # Nothing more of this request to read: the next one's reads start.
                        self._read_next(conn, sum(not f.done() for f in ahead.values()))
                    if out and not fut.done():
                        send_vec(conn, out)
                        out, out_bytes = [], 0
                        unsent.clear()
                    st, payload = fut.result()
                    del ahead[i]
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
