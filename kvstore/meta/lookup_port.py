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

- on connect, the client sends ``KVL1``; the service answers ``KVL1``, u32 the most keys a
  request may carry, and u64 its instance id (random per start, also advertised in lookup
  answers as ``lookup_port_id``: a client talks only to the instance it learned of);
- request: u32 key count | u32 flags (bit 0: per-key answer; others must be 0) | 16-byte keys;
- answer: u32 status (0, or a gRPC status code) | u32 value. Status 0: value = leading hit
  count, then, with bit 0, one byte per key (1 = stored). Otherwise value = length of a UTF-8
  message that follows.

A request over the key limit or with unknown flags is answered with INVALID_ARGUMENT and the
connection closed (its keys are never read); an empty one is answered and the connection stays,
up to ``MAX_ERRORS`` error answers. Bounded: at most ``max_connections`` connections (more are
closed at once), a connection's reading pauses while its unsent answers pass ``MAX_UNSENT``
bytes, at most ``FRAMES_PER_TURN`` frames of one connection are answered per turn of the event
loop (a flood of frames cannot hold the service's gRPC calls up), and a connection idle for
``idle_s`` is aborted.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
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
HELLO = struct.Struct("<4sIQ")  # magic, most keys per request, the service's instance id
PER_KEY = 1
MAX_UNSENT = 256 << 10  # unsent answers above which a connection's reading pauses
FRAMES_PER_TURN = 64  # frames answered per turn of the loop, per connection
MAX_ERRORS = 16  # error answers after which a connection is closed
MAX_PORT_KEYS = 1 << 16  # bigger batches go over gRPC


def status_of(code: grpc.StatusCode) -> int:
    return code.value[0]


class _Conn(asyncio.Protocol):
    def __init__(self, port: LookupPort) -> None:
        self.port = port
        self.buf = bytearray()
        self.t: asyncio.Transport | None = None
        self.greeted = False
        self.last = time.monotonic()
        self.errors = 0
        self.paused_writing = False  # the peer does not read its answers fast enough
        self.paused_work = False  # frames left over for a later turn of the loop
        self.done = False

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        if len(self.port.conns) >= self.port.max_connections:
            self.port.refused()
            transport.abort()
            self.done = True
            return
        transport.set_write_buffer_limits(high=MAX_UNSENT)
        self.port.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.done = True
        self.buf.clear()
        self.port.conns.discard(self)

    def _reading(self) -> None:
        if self.t is None or self.done:
            return
        if self.paused_writing or self.paused_work:
            self.t.pause_reading()
        else:
            self.t.resume_reading()

    def pause_writing(self) -> None:
        self.paused_writing = True
        self._reading()

    def resume_writing(self) -> None:
        self.paused_writing = False
        self._reading()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.last = time.monotonic()
        t = self.t
        if not self.greeted:
            if len(self.buf) < len(MAGIC):
                return
            if bytes(self.buf[: len(MAGIC)]) != MAGIC:
                self.close(abort=True)  # not a lookup-port client
                return
            del self.buf[: len(MAGIC)]
            self.greeted = True
            t.write(HELLO.pack(MAGIC, self.port.max_keys, self.port.instance))  # type: ignore[union-attr]
        if not self.paused_work:
            self._work()

    def close(self, abort: bool = False) -> None:
        self.done = True
        self.buf.clear()
        if self.t is not None:
            self.t.abort() if abort else self.t.close()

    def _work(self) -> None:
        """Answers at most FRAMES_PER_TURN frames, then lets the loop run (other connections,
        gRPC calls) before the rest: one connection never holds the service's loop for long."""
        if self.done:
            return
        buf, t, port = self.buf, self.t, self.port
        pos = 0
        out = []
        while len(buf) - pos >= HEAD.size and len(out) < FRAMES_PER_TURN:
            n, flags = HEAD.unpack_from(buf, pos)
            if flags & ~PER_KEY or n > port.max_keys:
                what = (
                    f"unknown flags {flags:#x}"
                    if flags & ~PER_KEY
                    else f"{n} keys is over the limit of {port.max_keys}"
                )
                out.append(port.error(grpc.StatusCode.INVALID_ARGUMENT, f"lookup port: {what}"))
                t.write(b"".join(out))  # type: ignore[union-attr]
                self.close()
                return
            end = pos + HEAD.size + n * KEY_BYTES
            if len(buf) < end:
                break
            answer, ok = port.answer(bytes(buf[pos + HEAD.size : end]), bool(flags & PER_KEY))
            out.append(answer)
            pos = end
            if not ok:
                self.errors += 1
                if self.errors >= MAX_ERRORS:  # a peer that only sends bad requests: let it go
                    t.write(b"".join(out))  # type: ignore[union-attr]
                    self.close()
                    return
        if pos:
            del buf[:pos]
        if out:
            t.write(out[0] if len(out) == 1 else b"".join(out))  # type: ignore[union-attr]
        more = len(out) == FRAMES_PER_TURN and len(buf) >= HEAD.size
        if more != self.paused_work:
            self.paused_work = more
            self._reading()
        if more:
            asyncio.get_running_loop().call_soon(self._work)


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
        self.max_keys = min(max_keys, MAX_PORT_KEYS)
        # Named in the hello and in the service's lookup answers, so that a client never takes
        # answers from another process that holds the port it learned (a restart, a forward).
        self.instance = secrets.randbits(63) | 1
        self.refusals = 0
        self._refused_logged = -1e9
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

    def answer(self, packed: bytes, per_key: bool) -> tuple[bytes, bool]:
        """The answer to one request, and whether it was not an error."""
        t0 = time.perf_counter()
        try:
            if not packed:
                return self.error(grpc.StatusCode.INVALID_ARGUMENT, "keys: empty batch"), False
            why = self.gate() if self.gate is not None else ""
            if why:
                return self.error(grpc.StatusCode.UNAVAILABLE, why), True
            try:
                hit, exists = self._lookup(packed, per_key)
            except KVStoreError as e:
                return self.error(e.code, e.message), False
            head = HEAD.pack(0, hit)
            return (head + bytes(exists) if per_key else head), True
        finally:
            if self._observe is not None:
                self._observe(time.perf_counter() - t0)

    def refused(self) -> None:
        """A connection over the bound: logged at most once every 10 s."""
        self.refusals += 1
        now = time.monotonic()
        if now - self._refused_logged >= 10.0:
            log.warning(
                "event=lookup_port_refused reason=too_many_connections limit=%d refused=%d",
                self.max_connections,
                self.refusals,
            )
            self._refused_logged = now

    async def start(self, host: str | None, port: int = 0) -> int:
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
                c.close(abort=True)  # abort: a peer that never reads would keep a close pending

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self.server is not None:
            self.server.close()
            for c in list(self.conns):
                if c.t is not None:
                    c.t.abort()
            await self.server.wait_closed()
