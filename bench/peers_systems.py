"""The systems bench/peers.py compares, behind one interface: kvstore (one transport per
adapter), Redis used as a block store, and Mooncake Store's Python client. Each adapter maps the
harness's calls (put, get, single get, existence checks, remove) onto the system's own API and
raises :class:`~bench.peers_harness.BenchError` on any wrong answer."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.peers_harness import BenchError, Buffers


class KVStorePeer:
    """kvstore through ``SyncKVStoreClient``, forced onto one transport. Its gets of blocks whose
    locations the client knows skip the metadata service (the default); a second client without a
    location cache measures the leased path too (``get_one_leased``)."""

    def __init__(self, meta: str, transport: str, tls: Any = None, name: str = "") -> None:
        from kvstore import SyncKVStoreClient
        from kvstore.config import ClientConfig

        self.name = name or f"kvstore-{transport}"
        self.client = SyncKVStoreClient(meta, ClientConfig(transport=transport), tls=tls)
        self.leased = SyncKVStoreClient(meta, ClientConfig(transport=transport, location_cache=0), tls=tls)

    def native(self, keys: list[bytes]) -> bytes:
        return b"".join(keys)  # the client takes packed keys (N x 16 bytes) as well as a list

    def native_one(self, key: bytes) -> bytes:
        return key

    def register(self, bufs: Buffers) -> Any:
        return None

    def unregister(self, handle: Any) -> None:
        pass

    def put(self, keys: bytes, bufs: Buffers) -> None:
        r = self.client.put(keys, bufs.arrays)
        if r.stored != len(bufs.arrays):
            raise BenchError(f"{self.name}: put stored {r.stored} of {len(bufs.arrays)} blocks ({r})")

    def get(self, keys: bytes, bufs: Buffers) -> None:
        got = self.client.get_into(keys, bufs.arrays)
        if got != len(bufs.arrays):
            raise BenchError(f"{self.name}: get_into loaded {got} of {len(bufs.arrays)} blocks")

    def get_one(self, key: bytes, bufs: Buffers, i: int) -> None:
        if self.client.get_into(key, [bufs.arrays[i]]) != 1:
            raise BenchError(f"{self.name}: single-block get_into missed")

    def get_one_leased(self, key: bytes, bufs: Buffers, i: int) -> None:
        if self.leased.get_into(key, [bufs.arrays[i]]) != 1:
            raise BenchError(f"{self.name}: single-block get_into (leased) missed")

    def exists(self, keys: bytes) -> int:
        return self.client.lookup(keys)

    def remove(self, keys: bytes) -> None:
        self.client.remove(keys)

    def close(self) -> None:
        self.client.close()
        self.leased.close()


class RedisPeer:
    """Redis as a block store: one key per block, pipelined SET / GET, multi-key EXISTS."""

    name = "redis"

    def __init__(self, port: int) -> None:
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=120)
        self.r.ping()

    def native(self, keys: list[bytes]) -> list[bytes]:
        return keys

    def native_one(self, key: bytes) -> bytes:
        return key

    def register(self, bufs: Buffers) -> Any:
        return None

    def unregister(self, handle: Any) -> None:
        pass

    def put(self, keys: list[bytes], bufs: Buffers) -> None:
        # Pipelined SETs rather than one MSET: with the hiredis packer, MSET builds the whole
        # batch as one buffer and runs at about half the speed.
        p = self.r.pipeline(transaction=False)
        for k, a in zip(keys, bufs.arrays):
            p.set(k, memoryview(a))
        if not all(p.execute()):
            raise BenchError("redis: a SET failed")

    def get(self, keys: list[bytes], bufs: Buffers) -> None:
        p = self.r.pipeline(transaction=False)
        for k in keys:
            p.get(k)
        for v, d in zip(p.execute(), bufs.arrays):
            if v is None or len(v) != d.size:
                raise BenchError(f"redis: GET returned {None if v is None else len(v)} bytes, expected {d.size}")
            np.copyto(d, np.frombuffer(v, np.uint8))  # into the caller's buffer, like get_into

    def get_one(self, key: bytes, bufs: Buffers, i: int) -> None:
        v = self.r.get(key)
        d = bufs.arrays[i]
        if v is None or len(v) != d.size:
            raise BenchError("redis: single GET missed")
        np.copyto(d, np.frombuffer(v, np.uint8))

    def exists(self, keys: list[bytes]) -> int:
        return self.r.exists(*keys)

    def remove(self, keys: list[bytes]) -> None:
        self.r.delete(*keys)

    def close(self) -> None:
        self.r.close()


class MooncakePeer:
    """Mooncake Store's Python client: zero-copy batch_put_from / batch_get_into on registered
    buffers, batch_is_exist for lookups. Runs only inside the private network namespace."""

    name = "mooncake"

    def __init__(self, metadata_url: str, master_addr: str, local_buffer_bytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        # global_segment_size 0: this client contributes no memory; the storage process does.
        rc = self.store.setup("127.0.0.1", metadata_url, 0, local_buffer_bytes, "tcp", "", master_addr)
        if rc != 0:
            raise BenchError(f"mooncake: client setup returned {rc}")

    def native(self, keys: list[bytes]) -> list[str]:
        return [k.hex() for k in keys]

    def native_one(self, key: bytes) -> str:
        return key.hex()

    def register(self, bufs: Buffers) -> Any:
        rc = self.store.register_buffer(bufs.flat.ctypes.data, bufs.flat.nbytes)
        if rc != 0:
            raise BenchError(f"mooncake: register_buffer returned {rc}")
        return bufs.flat.ctypes.data

    def unregister(self, handle: Any) -> None:
        self.store.unregister_buffer(handle)

    def put(self, keys: list[str], bufs: Buffers) -> None:
        rc = self.store.batch_put_from(keys, bufs.ptrs, bufs.sizes)
        bad = [r for r in rc if r != 0]
        if bad:
            raise BenchError(f"mooncake: batch_put_from failed for {len(bad)} of {len(rc)} objects (codes {set(bad)})")

    def get(self, keys: list[str], bufs: Buffers) -> None:
        rc = self.store.batch_get_into(keys, bufs.ptrs, bufs.sizes)
        bad = [r for r in rc if r != bufs.size]
        if bad:
            raise BenchError(f"mooncake: batch_get_into short for {len(bad)} of {len(rc)} objects (got {set(bad)})")

    def get_one(self, key: str, bufs: Buffers, i: int) -> None:
        rc = self.store.get_into(key, bufs.ptrs[i], bufs.size)
        if rc != bufs.size:
            raise BenchError(f"mooncake: get_into returned {rc}, expected {bufs.size}")

    def exists(self, keys: list[str]) -> int:
        return sum(1 for r in self.store.batch_is_exist(keys) if r == 1)

    def remove(self, keys: list[str]) -> None:
        # force: a get leaves a short read lease on the object; no reader is left at this point.
        rc = self.store.batch_remove(keys, True)
        bad = [r for r in rc if r != 0]
        if bad:
            raise BenchError(f"mooncake: batch_remove failed for {len(bad)} objects (codes {set(bad)})")

    def close(self) -> None:
        self.store.close()
