"""Property: whatever happens (puts, removals, evictions, daemon restarts, service restarts, in
any order), the blocks served are exactly the committed ones that were not removed or
evicted, and every served byte is right.

The real metadata service and cache daemon (DRAM arena in shared memory, SSD segment in real
files, gRPC on loopback) run in this process so that hypothesis can drive many sequences
quickly; restarts stop a server and start a new one on the same state (the arena file, the
SSD files, the port). Killed-process variants of the same races are in test_contract.py.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import xxhash

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvstore import KeySpace, ModelFingerprint  # noqa: E402
from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.config import ClientConfig, DaemonConfig, MetaConfig  # noqa: E402
from kvstore.daemon.server import CacheDaemon  # noqa: E402
from kvstore.meta.service import MetaServer  # noqa: E402

KS = KeySpace(ModelFingerprint("property-model", "bf16", 2, 2, 64))
BLOCK = 2000
CHAINS = 5
CHAIN_LEN = 10


def chain_keys(c: int) -> list[bytes]:
    return KS.block_keys(np.arange(c * 1000, c * 1000 + CHAIN_LEN * 16))


def block(key: bytes) -> np.ndarray:
    return np.random.default_rng(xxhash.xxh64_intdigest(key)).integers(0, 256, BLOCK, dtype=np.uint8)


OPS = st.one_of(
    st.tuples(st.just("put"), st.integers(0, CHAINS - 1), st.integers(1, CHAIN_LEN)),
    st.tuples(st.just("remove"), st.integers(0, CHAINS - 1), st.integers(0, CHAIN_LEN - 1), st.integers(1, 4)),
    st.tuples(st.just("evict"), st.integers(20, 80)),
    st.tuples(st.just("restart_daemon")),
    st.tuples(st.just("restart_service")),
)


class World:
    """One service, one daemon (DRAM + SSD), one client, and the model of what must be served."""

    def __init__(self, root: Path, shm: Path) -> None:
        self.root = root
        self.shm = shm
        self.port = 0
        self.meta: MetaServer | None = None
        self.daemon: CacheDaemon | None = None
        self.client: KVStoreClient | None = None
        self.committed: set[bytes] = set()  # put and not removed since (evictions aside)
        self.known: list[bytes] = []  # every key ever put, in order
        self.fillers = 0

    def meta_cfg(self) -> MetaConfig:
        return MetaConfig(
            listen=f"127.0.0.1:{self.port}",
            heartbeat_interval_s=0.05,
            daemon_ttl_s=30.0,
            sweep_interval_s=0.05,
            tier_interval_s=0.02,
            dram_high_watermark=0.6,
            dram_low_watermark=0.4,
        )

    def daemon_cfg(self) -> DaemonConfig:
        return DaemonConfig(
            meta=f"127.0.0.1:{self.port}",
            daemon_id="prop",
            data_dir=str(self.root / "daemon"),
            dram_bytes=96 << 10,
            shm_dir=str(self.shm),
            ssd_bytes=160 << 10,
            ssd_direct_io=False,
        )

    async def start_meta(self) -> None:
        self.meta = MetaServer(self.meta_cfg())
        self.port = await self.meta.start()
        self.client = KVStoreClient(f"127.0.0.1:{self.port}", ClientConfig(retries=0))

    async def start_daemon(self) -> None:
        self.daemon = CacheDaemon(self.daemon_cfg())
        await self.daemon.start()
        await asyncio.wait_for(self.daemon.registered.wait(), 30)

    async def stop(self) -> None:
        if self.client:
            await self.client.close()
        if self.daemon:
            await self.daemon.stop()
        if self.meta:
            await self.meta.stop(0)

    def visible(self) -> set[bytes]:
        assert self.meta is not None
        return set(self.meta.index.keys())

    async def put(self, keys: list[bytes]) -> None:
        assert self.client is not None
        from kvstore.errors import ResourceExhausted

        # Tier moves held meanwhile, so that what the put committed is still there to look up.
        await self.pause_tiering()
        try:
            try:
                res = await self.client.put(keys, [block(k) for k in keys])
            except ResourceExhausted:
                return
            for k in keys:
                if k not in self.committed:
                    self.known.append(k)
            self.committed |= set(keys)
            if res.rejected == 0:  # everything stored or already there: all visible right now
                assert await self.client.lookup(keys) == len(keys)
        finally:
            self.resume_tiering()

    async def check(self) -> None:
        """Served == committed minus removed minus evicted; bytes right."""
        vis = self.visible()
        extra = vis - self.committed
        assert not extra, f"{len(extra)} blocks visible that were removed or never committed"
        self.meta.index.check_integrity()
        assert self.client is not None
        for c in range(CHAINS):
            keys = chain_keys(c)
            out = [np.zeros(BLOCK, np.uint8) for _ in keys]
            n = await self.client.get_into(keys, out)
            for i in range(n):
                assert np.array_equal(out[i], block(keys[i])), f"chain {c} block {i}: wrong bytes"

    async def run(self, op: tuple) -> None:
        kind = op[0]
        if kind == "put":
            await self.put(chain_keys(op[1])[: op[2]])
        elif kind == "remove":
            keys = chain_keys(op[1])[op[2] : op[2] + op[3]]
            await self.client.remove(keys)
            self.committed -= set(keys)
        elif kind == "evict":
            self.fillers += 1
            keys = KS.block_keys(np.arange(10**6 * self.fillers, 10**6 * self.fillers + op[1] * 16))
            await self.put(keys)
        elif kind == "restart_daemon":
            await self.pause_tiering()
            before = self.visible()
            await self.daemon.stop()
            await self.start_daemon()
            after = self.visible()
            self.resume_tiering()
            assert after == before, f"daemon restart: lost {len(before - after)}, resurrected {len(after - before)}"
        elif kind == "restart_service":
            await self.client.close()
            await self.meta.stop(0)  # the background round in progress finishes first
            before_ids = set(self.meta.index.keys())
            await self.start_meta()
            await self.pause_tiering()
            await asyncio.wait_for(self._reregistered(), 30)
            after = self.visible()
            self.resume_tiering()
            lost, back = before_ids - after, after - before_ids
            assert not lost and not back, f"service restart: lost {len(lost)}, resurrected {len(back)}"
        await self.check()

    async def pause_tiering(self) -> None:
        """Holds the tier loop between rounds, so that a comparison across a restart is not
        disturbed by evictions the (legitimately) full DRAM tier triggers right after it. Moves
        already handed to the daemon (each daemon's batch runs on its own) finish first."""
        await self.meta._round.acquire()
        await asyncio.gather(*self.meta._moving.values(), return_exceptions=True)

    def resume_tiering(self) -> None:
        self.meta._round.release()

    async def _reregistered(self) -> None:
        while "prop" not in self.meta.index.daemons:
            await asyncio.sleep(0.01)


async def scenario(ops: list[tuple]) -> None:
    root = Path(tempfile.mkdtemp(prefix="kvprop-"))
    shm = Path(tempfile.mkdtemp(prefix="kvprop-", dir="/dev/shm"))
    w = World(root, shm)
    try:
        await w.start_meta()
        await w.start_daemon()
        for op in ops:
            await w.run(op)
    finally:
        await w.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(ops=st.lists(OPS, min_size=3, max_size=14))
def test_served_blocks_are_exactly_committed_minus_removed_and_evicted(ops):
    asyncio.run(scenario(ops))


def test_a_sequence_with_every_kind_of_step():
    """One fixed sequence that certainly evicts, demotes and restarts both sides."""
    ops = [("put", 0, 10), ("put", 1, 10), ("remove", 0, 3, 4), ("evict", 60), ("restart_service",),
           ("put", 0, 10), ("evict", 80), ("restart_daemon",), ("remove", 1, 0, 2), ("restart_service",),
           ("put", 2, 10), ("restart_daemon",), ("evict", 40), ("restart_service",)]  # fmt: skip
    asyncio.run(scenario(ops))
