"""The client's side of the metadata service's lookup port (:mod:`kvstore.meta.lookup_port`).

:class:`LookupPortClient`: blocking sockets used from the calling thread (no hop to the client's event loop), one per
concurrent caller, kept for reuse. Anything that goes wrong on the socket (refused, reset, closed,
cut short, timed out) or an UNAVAILABLE answer raises :class:`PortDown`, and the caller asks the
same question over gRPC: the port is a fast path, never the only one. A pooled socket that the
service closed meanwhile (idle, restarted) is retried once on a fresh connection: lookups have no
side effects. :class:`AsyncLookupPort`: the same from an event loop, requests pipelined on one
connection.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import deque
from typing import Any

import grpc

from kvstore.errors import error_for
from kvstore.keys import KEY_BYTES
from kvstore.meta.lookup_port import HEAD, HELLO, MAGIC, PER_KEY

_BY_STATUS = {code.value[0]: code for code in grpc.StatusCode}
MAX_IDLE = 16


class PortDown(Exception):
    """The lookup port cannot answer this call: ask over gRPC."""


class _Closed(PortDown):
    """The service closed the connection (end of stream)."""


def _closed_by_peer(e: BaseException) -> bool:
    """A pooled connection the service closed meanwhile (worth one more try), not a timeout."""
    return isinstance(e, (_Closed, ConnectionResetError, BrokenPipeError))


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:])
        if not k:
            raise _Closed("the lookup port closed the connection")
        got += k
    return bytes(buf)


def _refusal(status: int, message: str) -> Exception:
    """An error answer as the exception to raise: PortDown for UNAVAILABLE (or a status this
    client does not know: ask over gRPC), else the service's typed error."""
    code = _BY_STATUS.get(status)
    if code is None or code == grpc.StatusCode.UNAVAILABLE:
        return PortDown(message)
    return error_for(code, message)


class _Port:
    """Where the port is, which service instance must answer, and its key limit (from the hello)."""

    def __init__(self, host: str, port: int, timeout_s: float, instance: int = 0) -> None:
        self.addr = (host, port)
        self.instance = instance
        self.timeout_s = timeout_s
        self.max_keys = 0

    def usable(self, n: int) -> bool:
        """Whether a batch of ``n`` keys may go to the port (else: gRPC, with its own limits)."""
        return 0 < n <= (self.max_keys or n)


def _check_hello(addr: tuple[str, int], hello: bytes, instance: int) -> int:
    """The key limit from a hello; PortDown if it is not the instance the service advertised."""
    magic, max_keys, got = HELLO.unpack(hello)
    if magic != MAGIC or max_keys <= 0:
        raise PortDown(f"lookup port {addr}: not a kvstore lookup port")
    if instance and got != instance:
        raise PortDown(f"lookup port {addr}: another service instance holds it (restarted or forwarded)")
    return max_keys


class LookupPortClient(_Port):
    def __init__(self, host: str, port: int, timeout_s: float, instance: int = 0) -> None:
        super().__init__(host, port, timeout_s, instance)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self) -> socket.socket:
        try:
            s = socket.create_connection(self.addr, timeout=self.timeout_s)
        except OSError as e:
            raise PortDown(f"lookup port {self.addr}: {e}") from None
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(MAGIC)
            max_keys = _check_hello(self.addr, _recv_exact(s, HELLO.size), self.instance)
        except (OSError, PortDown) as e:
            s.close()
            raise PortDown(str(e)) from None
        self.max_keys = max_keys
        return s

    def _take(self) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._closed:
                raise PortDown("the lookup port client is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _give(self, s: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(s)
                return
        s.close()

    def ask(self, packed: bytes, per_key: bool) -> tuple[int, bytes]:
        """(leading hit count, per-key bytes or b"") for packed keys. Raises PortDown (ask
        over gRPC) or the service's typed error."""
        n = len(packed) // KEY_BYTES
        frame = HEAD.pack(n, PER_KEY if per_key else 0) + packed
        for attempt in (0, 1):
            s, reused = self._take()
            try:
                s.sendall(frame)
                status, value = HEAD.unpack(_recv_exact(s, HEAD.size))
                if status == 0:
                    if value > n:
                        raise PortDown(f"lookup port {self.addr}: {value} hits for {n} keys")
                    exists = _recv_exact(s, n) if per_key else b""
                    self._give(s)
                    return value, exists
                message = _recv_exact(s, min(value, 4096)).decode("utf-8", "replace")
            except (OSError, PortDown) as e:
                s.close()
                if reused and attempt == 0 and _closed_by_peer(e):
                    continue  # the service closed an idle connection: once more, on a new one
                raise PortDown(str(e)) from None
            s.close()
            raise _refusal(status, message)
        raise PortDown("unreachable")  # pragma: no cover

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


class _AsyncConn(asyncio.Protocol):
    """One connection of :class:`AsyncLookupPort`: requests pipelined, answers in order."""

    def __init__(self) -> None:
        self.t: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiting: deque[tuple[asyncio.Future, int, bool]] = deque()  # (future, keys, per key)
        self.hello: asyncio.Future = asyncio.get_running_loop().create_future()
        self.lost = False

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        transport.write(MAGIC)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        err = PortDown(f"the lookup port closed the connection ({exc or 'end of stream'})")
        if not self.hello.done():
            self.hello.set_exception(err)
        while self.waiting:
            fut = self.waiting.popleft()[0]
            if not fut.done():
                fut.set_exception(err)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.hello.done():
            if len(buf) < HELLO.size:
                return
            hello = bytes(buf[: HELLO.size])
            del buf[: HELLO.size]
            self.hello.set_result(hello)
        while self.waiting and len(buf) >= HEAD.size:
            fut, n, per_key = self.waiting[0]
            status, value = HEAD.unpack_from(buf)
            if (status == 0 and value > n) or (status != 0 and value > 4096):
                self.t.abort()  # type: ignore[union-attr] - an answer out of bounds: not to be trusted
                return
            more = (n if per_key else 0) if status == 0 else value
            if len(buf) < HEAD.size + more:
                return
            body = bytes(buf[HEAD.size : HEAD.size + more])
            del buf[: HEAD.size + more]
            self.waiting.popleft()
            if not fut.done():
                fut.set_result((status, value, body))


class AsyncLookupPort(_Port):
    """The lookup port from an event loop: one connection, requests pipelined on it (answers
    come back in order), made again after it breaks. Raises :class:`PortDown` like the blocking
    client."""

    def __init__(self, host: str, port: int, timeout_s: float, instance: int = 0) -> None:
        super().__init__(host, port, timeout_s, instance)
        self._conn: _AsyncConn | None = None
        self._connecting: asyncio.Lock | None = None
        self._closed = False

    async def _get(self) -> _AsyncConn:
        c = self._conn
        if c is not None and not c.lost:
            return c
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            c = self._conn
            if c is not None and not c.lost:
                return c
            if self._closed:
                raise PortDown("the lookup port client is closed")
            loop = asyncio.get_running_loop()
            c = None
            try:
                async with asyncio.timeout(self.timeout_s):
                    _, c = await loop.create_connection(_AsyncConn, *self.addr)
                    self.max_keys = _check_hello(self.addr, await c.hello, self.instance)
            except (OSError, TimeoutError, PortDown) as e:
                if c is not None and c.t is not None:
                    c.t.abort()
                raise PortDown(f"lookup port {self.addr}: {e!r}") from None
            if self._closed:  # closed while this connection was being made
                c.t.abort()  # type: ignore[union-attr]
                raise PortDown("the lookup port client is closed")
            c.t.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # type: ignore[union-attr]
            self._conn = c
            return c

    async def ask(self, packed: bytes, per_key: bool) -> tuple[int, bytes]:
        n = len(packed) // KEY_BYTES
        c = await self._get()
        fut = asyncio.get_running_loop().create_future()
        c.waiting.append((fut, n, per_key))
        c.t.write(HEAD.pack(n, PER_KEY if per_key else 0) + packed)  # type: ignore[union-attr]
        try:
            async with asyncio.timeout(self.timeout_s):
                status, value, body = await fut
        except TimeoutError:
            c.t.abort()  # type: ignore[union-attr] - its later answers would be out of step
            raise PortDown(f"lookup port {self.addr}: no answer in {self.timeout_s} s") from None
        if status == 0:
            return value, body
        raise _refusal(status, body.decode("utf-8", "replace"))

    def close(self) -> None:
        self._closed = True
        if self._conn is not None and self._conn.t is not None:
            self._conn.t.abort()  # waiting callers get PortDown at once
        self._conn = None


__all__ = ["AsyncLookupPort", "LookupPortClient", "PortDown"]
