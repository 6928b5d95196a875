"""The metadata service's lookup port with real processes: the same answers as gRPC lookups,
learned from the first gRPC answer, hostile frames refused without harm, a service that goes
away sends lookups back to gRPC (a typed error, never a hang). (With tenants there is no port:
tests/integration/test_tenants.py.)"""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np
import pytest

from kvstore import KeySpace, KVStoreClient, ModelFingerprint, SyncKVStoreClient
from kvstore.config import ClientConfig
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.meta.lookup_port import HEAD, HELLO, MAGIC
from kvstore.v1 import meta_pb2, meta_pb2_grpc

KS = KeySpace(ModelFingerprint("port-model", "bf16", 2, 2, 64))


def chain(n: int, start: int = 0) -> list[bytes]:
    return KS.block_keys(np.arange(start, start + 16 * n))


def advertised(meta: str) -> int:
    import grpc

    with grpc.insecure_channel(meta) as ch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        return stub.Lookup(meta_pb2.LookupRequest(keys=b"k" * 16), timeout=10).lookup_port


def connect(meta: str) -> socket.socket:
    s = socket.create_connection((meta.rsplit(":", 1)[0], advertised(meta)), timeout=10)
    s.sendall(MAGIC)
    magic, max_keys, instance = HELLO.unpack(recv(s, HELLO.size))
    assert magic == MAGIC and max_keys > 0 and instance
    return s


def recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        b = s.recv(n - len(out))
        if not b:
            break
        out += b
    return out


def test_port_answers_as_grpc_does(store):
    keys = chain(40)
    with (
        SyncKVStoreClient(store.meta_addr) as c,
        SyncKVStoreClient(store.meta_addr, ClientConfig(lookup_port=False)) as g,
    ):
        c.put(keys[:25], [np.full(4096, i, np.uint8) for i in range(25)])
        assert c.lookup(keys[:1]) == 1  # over gRPC: its answer names the port
        assert c._client.lookup_port is not None and g._client.lookup_port is None
        before = c.stats().counters["lookups"]
        for n in (1, 10, 25, 40):
            assert c.lookup(keys[:n]) == g.lookup(keys[:n]) == min(n, 25)
        assert c.exists(keys[20:30]) == g.exists(keys[20:30]) == [True] * 5 + [False] * 5
        assert c.exists(keys[30:]) == [False] * 10
        assert c.stats().counters["lookups"] >= before + 7  # the service counted them
        with pytest.raises(InvalidArgument):
            c.lookup([b"short"])  # a bad key is refused before anything is sent
        assert c.lookup(keys) == 25
        # Many threads at once, each with its own answer.
        from concurrent.futures import ThreadPoolExecutor

        lens = [int(x) for x in np.random.default_rng(0).integers(1, 41, 200)]
        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda n: c.lookup(keys[:n]), lens))
        assert got == [min(n, 25) for n in lens]


def test_hostile_frames_are_refused_and_the_service_carries_on(store):
    keys = chain(4)
    with SyncKVStoreClient(store.meta_addr) as c:
        c.put(keys, [np.full(4096, i, np.uint8) for i in range(4)])
    # Not the magic: closed without an answer.
    s = socket.create_connection((store.meta_addr.rsplit(":", 1)[0], advertised(store.meta_addr)), timeout=10)
    s.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert recv(s, 8) == b""
    s.close()
    # An empty batch: an error, and the connection stays.
    s = connect(store.meta_addr)
    s.sendall(HEAD.pack(0, 0))
    status, n = HEAD.unpack(recv(s, 8))
    assert status == 3 and b"empty" in recv(s, n)  # INVALID_ARGUMENT
    s.sendall(HEAD.pack(4, 1) + b"".join(keys))
    status, hit = HEAD.unpack(recv(s, 8))
    assert (status, hit, recv(s, 4)) == (0, 4, b"\x01" * 4)
    # Over the key limit (its keys are never read) and unknown flags: an error, then closed.
    for frame in (HEAD.pack(1 << 30, 0), HEAD.pack(1, 0x80) + keys[0]):
        s2 = connect(store.meta_addr)
        s2.sendall(frame)
        status, n = HEAD.unpack(recv(s2, 8))
        assert status == 3 and recv(s2, n)
        assert recv(s2, 1) == b""
        s2.close()
    # A frame cut short, then the connection dropped; random bytes after the magic.
    s3 = connect(store.meta_addr)
    s3.sendall(HEAD.pack(4, 0) + keys[0][:7])
    s3.close()
    rng = np.random.default_rng(1)
    for _ in range(20):
        s4 = connect(store.meta_addr)
        s4.sendall(rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8).tobytes())
        s4.close()
    s.close()
    # Nothing stored changed, and lookups still answer on the port and over gRPC.
    with SyncKVStoreClient(store.meta_addr) as c:
        assert c.lookup(keys) == 4 and c._client.lookup_port is not None
        assert c.lookup(keys) == 4
        got = np.empty((4, 4096), np.uint8)
        assert c.get_into(keys, list(got)) == 4
        assert all((got[i] == i).all() for i in range(4))


def test_a_service_that_goes_away_sends_lookups_back_to_grpc(cluster):
    meta = cluster.start_meta()
    cluster.start_daemon()
    keys = chain(3)
    c = SyncKVStoreClient(cluster.meta_addr, ClientConfig(rpc_timeout_s=2.0, retries=0))
    try:
        c.put(keys, [np.full(4096, 7, np.uint8) for _ in keys])
        assert c.lookup(keys) == 3 and c._client.lookup_port is not None
        meta.kill()
        with pytest.raises(KVStoreError):  # typed (Unavailable or Timeout over gRPC), never a hang
            c.lookup(keys)
        assert c._client.lookup_port is None
    finally:
        c.close()


def test_lookup_port_off(cluster):
    cluster.start_meta("meta.lookup_port=-1")
    assert advertised(cluster.meta_addr) == 0

    async def go() -> None:
        async with KVStoreClient(cluster.meta_addr) as c:
            assert await c.lookup(chain(2)) == 0
            assert c.lookup_port is None

    asyncio.run(go())


def test_config_refuses_a_port_with_tenants_or_out_of_range():
    from kvstore.config import Config, validate

    cfg = Config()
    cfg.meta.lookup_port = 70000
    with pytest.raises(InvalidArgument, match="meta.lookup_port"):
        validate(cfg)
    cfg.meta.lookup_port = 7200
    cfg.meta.auth_file = "/etc/kvstore/auth.toml"
    with pytest.raises(InvalidArgument, match="no identity"):
        validate(cfg)


def test_the_async_client_learns_the_port_but_keeps_asking_on_its_stream(store):
    async def go() -> None:
        async with KVStoreClient(store.meta_addr) as c:
            assert await c.lookup(chain(2)) == 0
            assert c.lookup_port is not None  # for the sync facade's calling threads

    asyncio.run(go())


def test_wire_sizes():
    assert HEAD.size == 8 and HELLO.size == 16 and struct.calcsize("<II") == 8


def test_async_lookups_go_to_the_port_pipelined_and_back_to_grpc_when_it_fails(store):
    keys = chain(30)

    async def go() -> None:
        async with KVStoreClient(store.meta_addr) as c:
            await c.put(keys[:20], [np.full(4096, i, np.uint8) for i in range(20)])
            assert await c.lookup(keys[:1]) == 1 and c._aport is not None
            lens = [int(x) for x in np.random.default_rng(2).integers(1, 31, 300)]
            got = await asyncio.gather(*(c.lookup(keys[:n]) for n in lens))
            assert got == [min(n, 20) for n in lens]
            assert await c.exists(keys[15:25]) == [True] * 5 + [False] * 5
            assert c._aport._conn is not None  # answered on the port
            # The connection breaks under it: the next lookup is answered over gRPC.
            c._aport._conn.t.abort()
            await asyncio.sleep(0.05)
            assert await c.lookup(keys) == 20
            tiers = await c.lookup_tiers(keys[:4])  # per-tier lookups stay on gRPC
            assert tiers.per_tier and tiers.tiers == b"\x01" * 4

    asyncio.run(go())


def test_a_restarted_service_is_asked_on_its_new_port_never_on_a_stranger_holding_the_old(cluster):
    import threading

    from kvstore.meta.lookup_port import LookupPort

    meta = cluster.start_meta()
    addr = cluster.meta_addr
    keys = chain(5)
    c = SyncKVStoreClient(addr, ClientConfig(rpc_timeout_s=4.0))
    try:
        assert c.lookup(keys) == 0 and c._client.lookup_port is not None
        old = c._client.lookup_port.addr[1]
        meta.kill()
        # A stranger takes the old lookup port and claims every key is stored.
        loop = asyncio.new_event_loop()
        th = threading.Thread(target=loop.run_forever, daemon=True)
        th.start()
        liar = LookupPort(lambda packed, per_key: (len(packed) // 16, [True] * (len(packed) // 16)), 64)
        asyncio.run_coroutine_threadsafe(liar.start("127.0.0.1", old), loop).result(10)
        try:
            cluster.start_meta(listen=addr)  # the service again, same gRPC address, a new port
            for _ in range(20):
                try:
                    assert c.lookup(keys) == 0  # never the stranger's 5
                    assert c.exists(keys) == [False] * 5
                except KVStoreError:
                    pass  # while the service comes back: a typed error, never a wrong answer
            assert c.lookup(keys) == 0
        finally:
            asyncio.run_coroutine_threadsafe(liar.stop(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            th.join(10)
    finally:
        c.close()
