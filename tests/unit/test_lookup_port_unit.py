"""The lookup port's server and clients in one process, with an injected lookup: answers, the
retry of a pooled connection the server closed for idleness, the connection bound, and typed
errors for what the lookup refuses."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvstore.client.lookup_port import AsyncLookupPort, LookupPortClient, PortDown
from kvstore.errors import InvalidArgument
from kvstore.meta.lookup_port import LookupPort

STORED = {bytes([i]) * 16 for i in range(8)}


def lookup(packed: bytes, per_key: bool) -> tuple[int, list[bool]]:
    keys = [packed[i : i + 16] for i in range(0, len(packed), 16)]
    if not keys:
        raise InvalidArgument("keys: empty batch")
    exists = [k in STORED for k in keys]
    hit = next((i for i, e in enumerate(exists) if not e), len(exists))
    return hit, exists if per_key else []


class Server:
    """A LookupPort on its own event loop thread."""

    def __init__(self, **kw) -> None:  # noqa: ANN003
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.observed: list[float] = []
        self.gate_reason = ""
        self.port = LookupPort(lookup, 64, gate=lambda: self.gate_reason, observe=self.observed.append, **kw)
        self.number = asyncio.run_coroutine_threadsafe(self.port.start("127.0.0.1"), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.port.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def server():
    s = Server(idle_s=0.4)
    yield s
    s.close()


def keys(*ids: int) -> bytes:
    return b"".join(bytes([i]) * 16 for i in ids)


def test_answers_and_typed_errors(server):
    c = LookupPortClient("127.0.0.1", server.number, 5.0)
    assert c.ask(keys(0, 1, 2), False) == (3, b"")
    assert c.ask(keys(0, 9, 2), True) == (1, b"\x01\x00\x01")
    assert c.max_keys == 64 and c.usable(64) and not c.usable(65) and not c.usable(0)
    with pytest.raises(InvalidArgument, match="empty"):
        c.ask(b"", False)
    assert c.ask(keys(3), False) == (1, b"")  # a fresh connection after the error closed one
    assert len(server.observed) >= 4
    server.gate_reason = "this shard's lease lapsed"
    with pytest.raises(PortDown, match="lease lapsed"):
        c.ask(keys(0), False)
    c.close()


def test_a_connection_closed_for_idleness_is_retried_once(server):
    c = LookupPortClient("127.0.0.1", server.number, 5.0)
    assert c.ask(keys(0), False) == (1, b"")
    deadline = time.monotonic() + 10
    while server.port.conns and time.monotonic() < deadline:  # the reaper closes it
        time.sleep(0.05)
    assert not server.port.conns
    assert c.ask(keys(0, 1), False) == (2, b"")  # the pooled socket was dead: a new one answered
    c.close()
    with pytest.raises(PortDown):
        c.ask(keys(0), False)


def test_connections_over_the_bound_are_closed():
    s = Server(max_connections=2)
    try:
        clients = [LookupPortClient("127.0.0.1", s.number, 5.0) for _ in range(3)]
        assert clients[0].ask(keys(0), False) == (1, b"")
        assert clients[1].ask(keys(0), False) == (1, b"")
        with pytest.raises(PortDown):
            clients[2].ask(keys(0), False)
        clients[0].close()
        time.sleep(0.2)
        assert clients[2].ask(keys(0), False) == (1, b"")  # room again
        for c in clients:
            c.close()
    finally:
        s.close()


def test_async_client_pipelines_and_reports_a_dead_port(server):
    async def go() -> None:
        c = AsyncLookupPort("127.0.0.1", server.number, 5.0)
        got = await asyncio.gather(*(c.ask(keys(*range(n)), n % 2 == 0) for n in range(1, 12)))
        for n, (hit, exists) in zip(range(1, 12), got):
            assert hit == min(n, 8)
            assert exists == (bytes(1 if i < 8 else 0 for i in range(n)) if n % 2 == 0 else b"")
        with pytest.raises(InvalidArgument):
            await c.ask(b"", False)
        c.close()
        dead = AsyncLookupPort("127.0.0.1", 1, 2.0)  # nothing listens on port 1
        with pytest.raises(PortDown):
            await dead.ask(keys(0), False)

    asyncio.run(go())


def test_a_port_held_by_another_instance_is_refused(server):
    other = server.port.instance ^ 2
    with pytest.raises(PortDown, match="another service instance"):
        LookupPortClient("127.0.0.1", server.number, 5.0, instance=other).ask(keys(0), False)
    assert LookupPortClient("127.0.0.1", server.number, 5.0, instance=server.port.instance).ask(keys(0), False) == (
        1,
        b"",
    )

    async def go() -> None:
        with pytest.raises(PortDown, match="another service instance"):
            await AsyncLookupPort("127.0.0.1", server.number, 5.0, instance=other).ask(keys(0), False)

    asyncio.run(go())


def test_waiting_async_callers_fail_at_once_when_the_connection_drops():
    """A peer that greets, then drops the connection with answers owed: every waiter gets
    PortDown at once, not after its timeout."""
    import socket
    import struct

    lst = socket.create_server(("127.0.0.1", 0))
    port = lst.getsockname()[1]

    def serve() -> None:
        conn, _ = lst.accept()
        conn.recv(4)
        conn.sendall(struct.pack("<4sIQ", b"KVL1", 64, 0))
        conn.recv(1 << 16)
        conn.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()

    async def go() -> float:
        c = AsyncLookupPort("127.0.0.1", port, 30.0)
        t = time.monotonic()
        got = await asyncio.gather(*(c.ask(keys(i), False) for i in range(3)), return_exceptions=True)
        assert all(isinstance(g, PortDown) for g in got), got
        return time.monotonic() - t

    assert asyncio.run(go()) < 15.0  # well under the 30 s timeout: the loss failed them
    th.join(5)
    lst.close()


def test_a_timeout_is_not_retried_on_a_new_connection():
    import socket
    import struct

    lst = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def serve() -> None:
        while True:
            try:
                conn, _ = lst.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.recv(4)
            conn.sendall(struct.pack("<4sIQ", b"KVL1", 64, 0))  # then never answers

    threading.Thread(target=serve, daemon=True).start()
    c = LookupPortClient("127.0.0.1", lst.getsockname()[1], 0.5)
    with pytest.raises(PortDown):
        c.ask(keys(0), False)
    with pytest.raises(PortDown):
        c.ask(keys(0), False)  # the timed-out socket was not pooled: a new one, timing out again
    assert len(accepted) == 2  # one connection per call: no retry after a timeout
    lst.close()
    for s in accepted:
        s.close()


def test_a_peer_sending_only_bad_requests_is_let_go(server):
    import socket

    from kvstore.meta.lookup_port import HEAD, HELLO, MAX_ERRORS

    s = socket.create_connection(("127.0.0.1", server.number), timeout=10)
    s.sendall(b"KVL1" + HEAD.pack(0, 0) * 1000)
    data = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        data += b
    answers = data[HELLO.size :]  # after the hello
    n = 0
    while answers:
        status, size = HEAD.unpack_from(answers)
        assert status == 3  # INVALID_ARGUMENT
        answers = answers[8 + size :]
        n += 1
    assert n == MAX_ERRORS
    s.close()


def test_a_flood_from_a_peer_that_never_reads_starves_no_one_and_is_reaped(server):
    import socket

    from kvstore.meta.lookup_port import HEAD

    flood = socket.create_connection(("127.0.0.1", server.number), timeout=10)
    flood.setblocking(False)
    frame = HEAD.pack(1, 1) + keys(0)
    sent = 0
    payload = b"KVL1" + frame * 20000
    deadline = time.monotonic() + 5
    while sent < len(payload) and time.monotonic() < deadline:
        try:
            sent += flood.send(payload[sent:])
        except BlockingIOError:
            time.sleep(0.01)
    # Another client is answered meanwhile.
    c = LookupPortClient("127.0.0.1", server.number, 10.0)
    assert c.ask(keys(0, 1), False) == (2, b"")
    c.close()
    # The flooder never reads: its connection is aborted once idle (idle_s = 0.4 here).
    deadline = time.monotonic() + 15
    while len(server.port.conns) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not server.port.conns
    flood.close()
