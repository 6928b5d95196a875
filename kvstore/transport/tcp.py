"""Cross-host transport: batched READ / WRITE frames to a daemon's data port.

Blocking sockets, meant to run in a worker thread: ``recv_into`` lands payloads straight in the
caller's buffers. Connections are pooled per daemon address and dropped on any error; idle ones
are closed after ``IDLE_S`` (and beyond ``MAX_IDLE`` per address), so that daemons that left
do not keep sockets open in every client.
"""

from __future__ import annotations

import itertools
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.extent import checksum
from kvstore.tickets import TICKET
from kvstore.transport import native
from kvstore.transport.frames import (
    ENTRY,
    MAGIC,
    REQ_HEAD,
    RESP_HEAD,
    STAGED_AT,
    VERSION,
    EntryStatus,
    FrameStatus,
    Op,
    kernel_timeouts,
    recv_bytes,
    recv_exact,
)
from kvstore.transport.sealed import client_upgrade

IDLE_S = 30.0
MAX_IDLE = 16


def _entry(key: bytes, segment_id: int, offset: int, length: int, csum: int, gen: int, ticket: bytes) -> bytes:
    tag, expiry = TICKET.unpack(ticket)
    return ENTRY.pack(key, segment_id, expiry, offset, length, csum, gen, tag)


# Per-entry failures a daemon may answer (anything else it sends counts as a MISMATCH).
_FAILED = frozenset((EntryStatus.MISMATCH, EntryStatus.CHECKSUM, EntryStatus.IO_ERROR))


class TcpTransport:
    def __init__(
        self,
        timeout_s: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str = "",
        sealed: bool = False,
    ) -> None:
        self.timeout_s = timeout_s
        self._ssl = ssl_context  # mutual TLS to the data ports (kvstore.tls)
        self._server_name = server_name
        self._sealed = sealed and ssl_context is not None  # sealed records after the handshake
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def _connect(self, addr: str) -> socket.socket:
        with self._lock:
            pool = self._idle.get(addr)
            if pool:
                return pool.pop()[0]
        host, _, port = addr.rpartition(":")
        try:
            s = socket.create_connection((host, int(port)), timeout=self.timeout_s)
        except OSError as e:
            raise Unavailable(f"data port {addr} unreachable: {e}") from None
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl is None:
            kernel_timeouts(s, self.timeout_s)  # TLS keeps the Python-level one (see there)
        else:
            try:
                s = self._ssl.wrap_socket(s, server_hostname=self._server_name)
            except OSError as e:
                s.close()
                raise Unavailable(f"data port {addr}: TLS handshake failed: {e}") from None
            if self._sealed:
                try:
                    s = client_upgrade(s)
                except OSError as e:
                    s.close()
                    raise Unavailable(f"data port {addr}: switch to sealed records failed: {e}") from None
        return s

    def _give_back(self, addr: str, s: socket.socket) -> None:
        with self._lock:
            pool = self._idle.setdefault(addr, [])
            pool.append((s, time.monotonic()))
            extra = pool[:-MAX_IDLE] if len(pool) > MAX_IDLE else []
            del pool[: len(extra)]
        for old, _t in extra:
            old.close()

    def prune(self, idle_s: float = IDLE_S) -> int:
        """Closes connections idle for longer than ``idle_s``; returns how many."""
        cutoff = time.monotonic() - idle_s
        stale = []
        with self._lock:
            for addr in list(self._idle):
                pool = self._idle[addr]
                stale += [s for s, t in pool if t < cutoff]
                pool[:] = [(s, t) for s, t in pool if t >= cutoff]
                if not pool:
                    del self._idle[addr]
        for s in stale:
            s.close()
        return len(stale)

    def idle(self) -> int:
        with self._lock:
            return sum(len(p) for p in self._idle.values())

    def _send(
        self, s: socket.socket, op: Op, entries: list[bytes], payloads: Sequence[np.ndarray] = (), flags: int = 0
    ) -> int:
        """Sends one frame; returns its request id."""
        req_id = next(self._ids)
        s.sendall(REQ_HEAD.pack(MAGIC, VERSION, op, flags, req_id, len(entries)) + b"".join(entries))
        for p in payloads:
            s.sendall(memoryview(p))
        return req_id

    def _answer(self, s: socket.socket, addr: str, op: Op, req_id: int, count: int) -> bytes:
        """Reads the head of the answer to request ``req_id``: its message (READ) or its
        per-entry statuses (WRITE)."""
        raw = recv_bytes(s, RESP_HEAD.size)
        if raw is None:
            raise Unavailable(f"data port {addr} closed the connection")
        magic, status, _op, _f, rid, n, msg_len = RESP_HEAD.unpack(raw)
        msg = recv_bytes(s, msg_len) if msg_len else b""
        if magic != MAGIC or rid != req_id:
            raise Unavailable(f"data port {addr} answered a malformed frame")
        if status != FrameStatus.OK:
            raise InvalidArgument(f"data port {addr} refused the frame: {(msg or b'').decode(errors='replace')}")
        if n != count:
            raise Unavailable(f"data port {addr} answered {n} statuses for {count} entries")
        if op == Op.READ:
            return msg or b""
        statuses = recv_bytes(s, count) if count else b""
        if statuses is None:
            raise Unavailable(f"data port {addr} closed the connection")
        return statuses

    def read(
        self,
        addr: str,
        items: Sequence[tuple],
        dests: Sequence[np.ndarray],
        flags: int = 0,
        staging: Callable[[str, int, int, int], Any] | None = None,
    ) -> list[bool]:
        """Reads ``items`` (key, segment_id, offset, length, checksum, gen, ticket) into ``dests``
        (``flags``: the head's, e.g. ``frames.DIRECT``; with ``frames.STAGED``, ``staging(path,
        size, request_bytes, inode)`` maps the daemon's staging region, and blocks the daemon
        staged there are copied from it: verified in place by the daemon, not checksummed again).

        Returns per item whether its bytes arrived and match the checksum. Raises Unavailable
        if the daemon cannot be reached (the caller turns that into misses).
        """
        done, err = self.read_parts(addr, [(items, dests)], flags, staging)
        if err is not None:
            raise err
        return [st == EntryStatus.OK for st in done[0]]

    def read_parts(
        self,
        addr: str,
        parts: Sequence[tuple[Sequence[tuple], Sequence[np.ndarray]]],
        flags: int = 0,
        staging: Callable[[str, int, int, int], Any] | None = None,
    ) -> tuple[list[list[int]], Unavailable | InvalidArgument | None]:
        """Reads several requests' worth, ``parts`` of (items, dests) as :meth:`read` takes
        them, on one connection with two requests in flight: the next is sent before this one's
        answer is read, so the daemon goes on to it without waiting for the client. (A staged
        request is sent only once every answer but the last is copied: the daemon's staging
        halves rely on it, kvstore.daemon.staging.)

        Returns per part read its per-item statuses (``EntryStatus``: OK, STAGED counting as OK;
        MISMATCH: the extent no longer holds that block; CHECKSUM: its bytes are bad, as the
        daemon read them or as they arrived; IO_ERROR), stopping after the part (and the one in
        flight behind it) where an item failed; and the error that stopped it early, if any
        (Unavailable, or InvalidArgument for a frame the daemon refused).
        """
        done: list[list[int]] = []
        try:
            s = self._connect(addr)
        except Unavailable as e:
            return done, e
        entries = [[_entry(*it) for it in items] for items, _d in parts]
        try:
            ids = [self._send(s, Op.READ, entries[0], flags=flags)]
            for k, (items, dests) in enumerate(parts):
                if k + 1 < len(parts) and (not done or all(st == EntryStatus.OK for st in done[-1])):
                    ids.append(self._send(s, Op.READ, entries[k + 1], flags=flags))
                msg = self._answer(s, addr, Op.READ, ids[k], len(items))
                done.append(self._recv_read(s, addr, items, dests, msg, staging))
                if len(ids) == k + 1:  # nothing more in flight: an item failed
                    break
        except OSError as e:
            s.close()
            return done, Unavailable(f"data port {addr}: {e}")
        except (Unavailable, InvalidArgument) as e:
            s.close()
            return done, e
        except Exception:
            s.close()
            raise
        self._give_back(addr, s)
        return done, None

    @staticmethod
    def _recv_read(
        s: socket.socket,
        addr: str,
        items: Sequence[tuple],
        dests: Sequence[np.ndarray],
        msg: bytes,
        staging: Callable[[str, int, int, int], Any] | None,
    ) -> list[int]:
        """The per-item part of a READ answer, into ``dests``: per item its EntryStatus (OK for
        a staged block copied; CHECKSUM for streamed bytes that do not match)."""
        region = None
        if msg and staging is not None:
            path, size, request_bytes, inode = (msg.decode(errors="replace").split("\n") + ["", "", "", ""])[:4]
            try:
                region = staging(path, int(size), int(request_bytes), int(inode))
            except (OSError, ValueError) as e:
                raise Unavailable(f"data port {addr}: cannot map its staging region {path}: {e}") from None
        if region is None and native.impl is not None and type(s) is socket.socket and s.gettimeout() is None:
            # A plain blocking socket: the whole answer in one GIL-free call. Not for staged
            # answers: their blocks are copied as each status arrives, while the daemon is still
            # reading the next ones from disk.
            return list(native.impl.recv_blocks(s.fileno(), dests, [it[4] for it in items]))
        ok = []
        status = bytearray(1)
        at = bytearray(STAGED_AT.size - 1)
        for (_k, _s, _o, n, c, _g, _t), dest in zip(items, dests):
            if not recv_exact(s, memoryview(status)):
                raise ConnectionError("data port closed mid-response")
            if status[0] == EntryStatus.STAGED:
                if not recv_exact(s, memoryview(at)):
                    raise ConnectionError("data port closed mid-response")
                off = int.from_bytes(at, "little")
                if region is None or off + n > region.size:
                    raise ConnectionError("data port staged a block outside its staging region")
                np.copyto(dest, region.array[off : off + n])
                ok.append(EntryStatus.OK)
                continue
            if status[0] != EntryStatus.OK:
                ok.append(status[0] if status[0] in _FAILED else EntryStatus.MISMATCH)
                continue
            if not recv_exact(s, memoryview(dest)):
                raise ConnectionError("data port closed mid-response")
            ok.append(EntryStatus.OK if checksum(dest) == c else EntryStatus.CHECKSUM)
        return ok

    def write(self, addr: str, items: Sequence[tuple], srcs: Sequence[np.ndarray]) -> list[bool]:
        """Writes payloads to their extents (pending until the put is committed); per item
        whether the daemon received it whole."""
        entries = [_entry(*it) for it in items]
        s = self._connect(addr)
        try:
            statuses = self._answer(s, addr, Op.WRITE, self._send(s, Op.WRITE, entries, srcs), len(entries))
        except OSError as e:
            s.close()
            raise Unavailable(f"data port {addr}: {e}") from None
        except Exception:
            s.close()
            raise
        self._give_back(addr, s)
        return [st == EntryStatus.OK for st in statuses]

    def close(self) -> None:
        with self._lock:
            for pool in self._idle.values():
                for s, _t in pool:
                    s.close()
            self._idle.clear()
