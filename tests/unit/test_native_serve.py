"""The daemon's native answers to READ frames on DRAM (kvstore/transport/serve.c, used by
kvstore.daemon.dataport) give byte for byte the answers of its Python path, over real sockets and
a real shared-memory arena: blocks that are there, headers that name another block, generation or
length, cleared, forged or moved headers; and a frame the Python check refuses (tickets expired
or not matching, extents outside their segment, lengths over the limit, unknown segments) is
never served natively, so that the peer gets the Python check's reason."""

from __future__ import annotations

import hashlib
import random
import socket
import threading
import time

import numpy as np
import pytest

from kvstore import tickets
from kvstore.daemon.arena import ShmArena
from kvstore.daemon.dataport import DataPort
from kvstore.daemon.entries import check_entries
from kvstore.extent import HEADER_SIZE, Sealer, checksum, extent_size
from kvstore.transport import native
from kvstore.transport.frames import ENTRY, FrameError, Op

pytestmark = pytest.mark.skipif(native.impl is None, reason="the native module is not built here")

SEG = 7
SECRET = bytes(range(32))


def test_blake2b_equals_hashlib():
    r = random.Random(5)
    for _ in range(2000):
        key, msg = r.randbytes(r.randint(1, 64)), r.randbytes(r.randint(1, 128))
        n = r.choice([8, 16, 32, 64, r.randint(1, 64)])
        assert native.impl.blake2b_mac(key, msg, n) == hashlib.blake2b(msg, key=key, digest_size=n).digest()
    with pytest.raises(ValueError):
        native.impl.blake2b_mac(b"", b"x", 16)
    with pytest.raises(ValueError):
        native.impl.blake2b_mac(b"k", bytes(129), 16)


class Store:
    """A daemon's DRAM arena with committed blocks (each block's bytes derived from its index)."""

    def __init__(self, path, n: int = 48, ticket_key: bytes = b"t" * 32) -> None:
        self.sealer = Sealer(SECRET)
        self.arena = ShmArena(path, 1 << 22, create=True)
        self.key = ticket_key
        self.port = DataPort("127.0.0.1", 0, lambda: {SEG: self.arena}, self.sealer, ticket_key=ticket_key)
        self.blocks = []  # (key, offset, length, gen)
        rng = np.random.default_rng(1)
        off = 0
        for i in range(n):
            length = int(rng.choice([1, 100, 4096, 20_000]))
            data = rng.integers(0, 256, length, dtype=np.uint8)
            self.arena.array[off + HEADER_SIZE : off + HEADER_SIZE + length] = data
            k = i.to_bytes(16, "little")
            self.arena.commit(self.sealer, off, k, length, checksum(data), 1000 + i)
            self.blocks.append((k, off, length, 1000 + i))
            off += extent_size(length)

    def entry(self, key: bytes, off: int, length: int, gen: int, expiry: int | None = None, seg: int = SEG) -> bytes:
        expiry = int(time.time()) + 60 if expiry is None else expiry
        mac = tickets.mac(self.key, tickets.READ, seg, off, length, gen, expiry, key) if self.key else bytes(16)
        return ENTRY.pack(key, seg, expiry, off, length, 0, gen, mac)

    def answer(self, raw: bytes, native_path: bool) -> bytes:
        """The whole answer to a READ frame of ``raw`` entries, on one path."""
        a, b = socket.socketpair()
        got = bytearray()

        def drain() -> None:
            while chunk := b.recv(1 << 20):
                got.extend(chunk)

        t = threading.Thread(target=drain)
        t.start()
        try:
            if native_path:
                plan = self.port._native_plan(a, Op.READ, raw)
                assert plan is not None, "the frame was not served natively"
                self.port._read(a, Op.READ, 9, [], [], 0, raw, plan)
            else:
                entries = list(ENTRY.iter_unpack(raw))
                arenas = self.port._check(entries, Op.READ)
                self.port._read(a, Op.READ, 9, entries, arenas, 0)
        finally:
            a.close()
            t.join()
            b.close()
        return bytes(got)

    def close(self) -> None:
        self.port.stop()
        self.arena.close()


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "arena")
    yield s
    s.close()


def test_answers_equal_the_python_path(store):
    rng = random.Random(3)
    for trial in range(60):
        parts = []
        for _ in range(rng.randint(1, 40)):
            k, off, length, gen = rng.choice(store.blocks)
            kind = rng.randint(0, 5)
            if kind == 1:  # another generation of that extent
                gen += 1
            elif kind == 2:  # another key
                k = bytes(16)
            elif kind == 3:  # another length that still fits the segment
                length += 1
            parts.append(store.entry(k, off, length, gen))
        # Change the arena between frames: a cleared, a forged, a moved header.
        k, off, length, gen = rng.choice(store.blocks)
        what = trial % 4
        if what == 1:
            store.arena.clear_header(off)
        elif what == 2:
            raw = bytearray(store.arena.view[off : off + HEADER_SIZE])
            raw[60] ^= 1  # the seal
            store.arena.view[off : off + HEADER_SIZE] = bytes(raw)
        elif what == 3:
            k2, off2, _l2, _g2 = rng.choice(store.blocks)
            store.arena.view[off : off + HEADER_SIZE] = bytes(store.arena.view[off2 : off2 + HEADER_SIZE])
        raw = b"".join(parts)
        py = store.answer(raw, False)
        assert store.answer(raw, True) == py, trial
        if what:  # put the block back as committed
            store.arena.commit(store.sealer, off, k, length, 0, gen)


def test_served_bytes_are_the_blocks(store):
    raw = b"".join(store.entry(*b) for b in store.blocks)
    got = store.answer(raw, True)
    want = b"".join(
        b"\x00" + bytes(store.arena.view[off + HEADER_SIZE : off + HEADER_SIZE + n]) for _k, off, n, _g in store.blocks
    )
    assert got[24:] == want  # after the response head
    assert store.port.counters["reads"] == len(store.blocks)
    assert store.port.counters["read_bytes"] == sum(n for _k, _o, n, _g in store.blocks)


def plan_of(store: Store, raw: bytes):  # noqa: ANN201
    """What the data port would serve natively of a READ frame of ``raw`` on a plain socket."""
    with socket.socket() as s:
        return store.port._native_plan(s, Op.READ, raw)


def refused(store: Store, raw: bytes) -> None:
    """The frame is not served natively, and the Python check refuses it."""
    assert plan_of(store, raw) is None
    with pytest.raises(FrameError):
        check_entries(
            list(ENTRY.iter_unpack(raw)), Op.READ, {SEG: store.arena}, store.port.max_block_bytes, store.key, 30
        )


@pytest.mark.parametrize(
    "bad",
    ["expired", "mac", "other_gen_ticket", "outside", "zero_length", "unknown_segment", "over_limit", "write_ticket"],
)
def test_frames_the_python_check_refuses_are_not_served_natively(store, bad):
    k, off, length, gen = store.blocks[3]
    good = [store.entry(*b) for b in store.blocks[:5]]
    if bad == "expired":
        e = store.entry(k, off, length, gen, expiry=int(time.time()) - 3600)
    elif bad == "mac":
        e = bytearray(store.entry(k, off, length, gen))
        e[-1] ^= 1
        e = bytes(e)
    elif bad == "other_gen_ticket":  # a ticket for gen, sent for gen + 1
        e = bytearray(store.entry(k, off, length, gen))
        e[48:56] = (gen + 1).to_bytes(8, "little")
        e = bytes(e)
    elif bad == "outside":
        e = store.entry(k, store.arena.size - HEADER_SIZE - 10, 11, gen)
    elif bad == "zero_length":
        e = store.entry(k, off, 0, gen)
    elif bad == "unknown_segment":
        e = store.entry(k, off, length, gen, seg=SEG + 1)
    elif bad == "over_limit":
        store.port.max_block_bytes = length - 1
        e = store.entry(k, off, length, gen)
    else:  # a WRITE ticket for the same extent
        expiry = int(time.time()) + 60
        mac = tickets.mac(store.key, tickets.WRITE, SEG, off, length, gen, expiry, k)
        e = ENTRY.pack(k, SEG, expiry, off, length, 0, gen, mac)
    refused(store, b"".join(good[:2] + [e] + good[2:]))
    store.port.max_block_bytes = 1 << 30
    ok = b"".join(good)
    assert plan_of(store, ok) is not None


def test_one_key_per_frame_or_the_python_path(tmp_path):
    s = Store(tmp_path / "arena")
    try:
        raw = b"".join(s.entry(*b) for b in s.blocks[:4])
        # Keys per metadata shard: natively only when one shard hands out every ticket.
        s.port.ticket_key = lambda seg, off: s.key
        s.port.one_ticket_key = None
        assert plan_of(s, raw) is None
        s.port.one_ticket_key = lambda: None
        assert plan_of(s, raw) is None
        s.port.one_ticket_key = lambda: b""  # no shard has given its key yet: never "no check"
        assert plan_of(s, raw) is None
        s.port.one_ticket_key = lambda: s.key
        assert plan_of(s, raw) is not None
        s.port.one_ticket_key = lambda: b"x" * 32  # another key: the MACs do not match
        assert plan_of(s, raw) is None
    finally:
        s.close()


def test_unsigned_store_serves_without_tickets(tmp_path):
    s = Store(tmp_path / "arena", ticket_key=b"")
    try:
        raw = b"".join(s.entry(*b) for b in s.blocks[:6])
        assert s.answer(raw, True) == s.answer(raw, False)
    finally:
        s.close()


def test_a_peer_that_closes_is_an_os_error(store):
    raw = b"".join(store.entry(*b) for b in store.blocks) * 40
    a, b = socket.socketpair()
    b.close()
    plan = store.port._native_plan(a, Op.READ, raw)
    assert plan is not None
    with pytest.raises(OSError):
        native.impl.serve_reads(a.fileno(), b"head", raw, plan[0], plan[1], store.sealer.secret)
    a.close()


def test_bad_arguments_are_typed_errors(store):
    raw = store.entry(*store.blocks[0])
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(ValueError):
            native.impl.serve_reads(a.fileno(), b"", raw[:-1], [SEG], [store.arena.view], SECRET)
        with pytest.raises(ValueError):  # an entry outside the segments given: nothing is sent
            native.impl.serve_reads(a.fileno(), b"head", raw, [SEG + 1], [store.arena.view], SECRET)
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)
    with pytest.raises(ValueError):
        native.impl.check_reads(raw[:-1], [SEG], [store.arena.size], b"", 0.0, 0.0, 1 << 30)
    with pytest.raises(TypeError):
        native.impl.check_reads(raw, ["x"], [1], b"", 0.0, 0.0, 1 << 30)
    # A length limit the native check cannot hold as u64: no length passes there (the Python
    # check decides), and a limit that is no int is refused there, not served.
    assert native.impl.check_reads(raw, [SEG], [store.arena.size], store.key, time.time(), 30.0, -1) == 0
    store.port.max_block_bytes = "big"
    assert plan_of(store, raw) is None


def test_a_socket_with_a_python_timeout_takes_the_python_path(store):
    raw = store.entry(*store.blocks[0])
    with socket.socket() as s:
        s.settimeout(5)
        assert store.port._native_plan(s, Op.READ, raw) is None


def test_one_ticket_key_is_the_one_shard_s_key_only():
    from types import SimpleNamespace

    from kvstore.daemon.server import CacheDaemon

    one = SimpleNamespace(links=[SimpleNamespace(ticket_key=b"k" * 32)])
    assert CacheDaemon.one_ticket_key(one) == b"k" * 32
    two = SimpleNamespace(links=[SimpleNamespace(ticket_key=b"k" * 32), SimpleNamespace(ticket_key=b"j" * 32)])
    assert CacheDaemon.one_ticket_key(two) is None


class Counting:
    """The native module, counting its serve_reads calls."""

    def __init__(self, impl) -> None:  # noqa: ANN001
        self.impl, self.served = impl, 0

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.impl, name)

    def serve_reads(self, *args):  # noqa: ANN002, ANN201
        self.served += 1
        return self.impl.serve_reads(*args)


def request(port: int, raw: bytes, flags: int = 0) -> bytes:
    """A READ frame of ``raw`` entries sent to the data port; its whole answer."""
    from kvstore.transport.frames import MAGIC, REQ_HEAD, RESP_HEAD, VERSION

    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(REQ_HEAD.pack(MAGIC, VERSION, Op.READ, flags, 5, len(raw) // ENTRY.size) + raw)
        c.shutdown(socket.SHUT_WR)
        got = bytearray()
        while chunk := c.recv(1 << 20):
            got += chunk
    head = RESP_HEAD.unpack(bytes(got[: RESP_HEAD.size]))
    assert head[1] == 0 and head[5] == len(raw) // ENTRY.size, head
    return bytes(got)


def test_the_port_serves_dram_reads_natively(store, monkeypatch):
    """Through the real port: a READ frame of DRAM blocks is answered by the native path, with
    the blocks' bytes; a lease-less (DIRECT) read past a drain's grace is all misses."""
    from kvstore.transport.frames import DIRECT

    counting = Counting(native.impl)
    monkeypatch.setattr(native, "impl", counting)
    store.port.start()
    raw = b"".join(store.entry(*b) for b in store.blocks)
    got = request(store.port.port, raw)
    want = b"".join(
        b"\x00" + bytes(store.arena.view[o + HEADER_SIZE : o + HEADER_SIZE + n]) for _k, o, n, _g in store.blocks
    )
    assert got[24:] == want
    assert counting.served == 1
    store.port.direct_until = 0.0
    got = request(store.port.port, raw, DIRECT)
    assert got[24:] == b"\x01" * len(store.blocks) and counting.served == 1
