"""The metadata service's lookup port: plain lookups over a framed TCP socket, without gRPC.

A one-key lookup is a dictionary probe; over gRPC Python it costs a round trip of 0.6-0.8 ms on
this kind of machine (both stacks' per-call work, ``shared/LIMITS.md``), ten times a Redis
``EXISTS``. The lookup port answers the same question (``Index.lookup``: the leading hit count,
optionally per key) on the service's event loop, between its gRPC calls, so that answers are as
consistent as the gRPC ones, for the cost of one socket round trip.

Served only by a service with neither TLS nor tenants (the port carries no identity: it is for a
trusted network, like the embedded ``kvstore serve``); the service advertises it in every
``LookupResponse`` (``lookup_port``), so a client learns it from its first gRPC lookup. A
service that is not allowed to answer (a shard whose lease lapsed) answers UNAVAILABLE and the
client goes back to gRPC.

Wire (little-endian):

- on connect, the client sends ``KVL1``; the service answers ``KVL1`` and u32 the most keys a
  request may carry;
- request: u32 key count | u32 flags (bit 0: per-key answer; others must be 0) | 16-byte keys;
- answer: u32 status (0, or a gRPC status code) | u32 value. Status 0: value = leading hit
  count, then, with bit 0, one byte per key (1 = stored). Otherwise value = length of a UTF-8
  message that follows.

A request over the key limit or with unknown flags is answered with INVALID_ARGUMENT and the
connection closed (its keys are never read); an empty one is answered and the connection stays.
Bounded: at most ``max_connections`` connections (more are closed at once), reading pauses
while a connection's unsent answers pass ``MAX_UNSENT`` bytes, and a connection idle for
``idle_s`` is closed.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvstore.errors import KVStoreError
from kvstore.keys import KEY_BYTES

log = logging.getLogger("kvstore.meta")

MAGIC = b"KVL1"
HEAD = struct.Struct("<II")  # request: key count, flags; answer: status, value
HELLO = struct.Struct("<4sI")  # magic, most keys per request
PER_KEY = 1
MAX_UNSENT = 4 << 20


def status_of(code: grpc.StatusCode) -> int:
    return code.value[0]


class _Conn(asyncio.Protocol):
    def __init__(self, port: LookupPort) -> None:
        self.port = port
        self.buf = bytearray()
        self.t: asyncio.Transport | None = None
        self.greeted = False
        self.last = time.monotonic()

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        if len(self.port.conns) >= self.port.max_connections:
            log.warning("event=lookup_port_refused reason=too_many_connections limit=%d", self.port.max_connections)
            transport.abort()
            return
        self.port.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.port.conns.discard(self)

    def pause_writing(self) -> None:
        if self.t is not None:
            self.t.pause_reading()

    def resume_writing(self) -> None:
        if self.t is not None:
            self.t.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.last = time.monotonic()
        buf, t = self.buf, self.t
        if not self.greeted:
            if len(buf) < len(MAGIC):
                return
            if bytes(buf[: len(MAGIC)]) != MAGIC:
                t.abort()  # type: ignore[union-attr] - not a lookup-port client
                return
            del buf[: len(MAGIC)]
            self.greeted = True
            t.write(HELLO.pack(MAGIC, self.port.max_keys))  # type: ignore[union-attr]
        pos = 0
        out = []
        while len(buf) - pos >= HEAD.size:
            n, flags = HEAD.unpack_from(buf, pos)
            if flags & ~PER_KEY or n > self.port.max_keys:
                what = (
                    f"unknown flags {flags:#x}"
                    if flags & ~PER_KEY
                    else f"{n} keys is over the limit of {self.port.max_keys}"
                )
                out.append(self.port.error(grpc.StatusCode.INVALID_ARGUMENT, f"lookup port: {what}"))
                t.write(b"".join(out))  # type: ignore[union-attr]
                t.close()  # type: ignore[union-attr]
                buf.clear()
                return
            end = pos + HEAD.size + n * KEY_BYTES
            if len(buf) < end:
                break
            out.append(self.port.answer(bytes(buf[pos + HEAD.size : end]), bool(flags & PER_KEY)))
            pos = end
        if pos:
            del buf[:pos]
        if out:
            t.write(out[0] if len(out) == 1 else b"".join(out))  # type: ignore[union-attr]


class LookupPort:
    """Serves ``index.lookup`` on a TCP port (see the module docstring)."""

    def __init__(
        self,
        lookup: Callable[[bytes, bool], tuple[int, list[bool]]],
        max_keys: int,
        gate: Callable[[], str] | None = None,
        max_connections: int = 256,
        idle_s: float = 300.0,
        observe: Any = None,
        error: Any = None,
    ) -> None:
        self._lookup = lookup
        self.max_keys = max_keys
        self.gate = gate
        self.max_connections = max_connections
        self.idle_s = idle_s
        self._observe = observe
        self._error = error
        self.conns: set[_Conn] = set()
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self._reaper: asyncio.Task | None = None

    def error(self, code: grpc.StatusCode, message: str) -> bytes:
        if self._error is not None:
            self._error(code.name)
        m = message.encode()[:4096]
        return HEAD.pack(status_of(code), len(m)) + m

    def answer(self, packed: bytes, per_key: bool) -> bytes:
        t0 = time.perf_counter()
        try:
            why = self.gate() if self.gate is not None else ""
            if why:
                return self.error(grpc.StatusCode.UNAVAILABLE, why)
            try:
                hit, exists = self._lookup(packed, per_key)
            except KVStoreError as e:
                return self.error(e.code, e.message)
            head = HEAD.pack(0, hit)
            return head + bytes(exists) if per_key else head
        finally:
            if self._observe is not None:
                self._observe(time.perf_counter() - t0)

    async def start(self, host: str, port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Conn(self), host, port, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]
        self._reaper = asyncio.create_task(self._reap())
        return self.port

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.idle_s / 2))
            cut = time.monotonic() - self.idle_s
            for c in [c for c in self.conns if c.last < cut]:
                if c.t is not None:
                    c.t.close()

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self.server is not None:
            self.server.close()
            for c in list(self.conns):
                if c.t is not None:
                    c.t.abort()
            await self.server.wait_closed()
