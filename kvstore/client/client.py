"""``KVStoreClient``: the asyncio client library.

Every call is batched: one metadata RPC per call however many keys, bytes moved straight
between the caller's buffers and the daemons (shared memory on the same host, the data port
otherwise). Misses are data (counts), never exceptions; errors are
:mod:`kvstore.errors` classes.

    async with KVStoreClient("127.0.0.1:7100") as c:
        await c.put(keys, buffers)            # PutStart -> copy -> PutCommit
        n = await c.lookup(keys)              # leading hit count, no side effects
        n = await c.get_into(keys, buffers)   # Acquire (lease) -> copy + verify -> Release

Reads of blocks whose location the client already knows (from an earlier get or its own put)
skip the metadata service: they copy from that location and verify, and a block that moved on
meanwhile is a miss there, read again through the leased path (:mod:`kvstore.client.locations`).
The service learns of those reads in batches (``Touch``), off the caller's path, so that its
cache policy still sees them.

The class is split where its seams are: this file holds its state, lookups and management; the
read path is :mod:`kvstore.client.reads`, the write path :mod:`kvstore.client.writes`, what it
remembers of locations :mod:`kvstore.client.locations`, the lookup stream
:mod:`kvstore.client.streams`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from kvstore.client.buffers import INLINE_COPY_BYTES
from kvstore.client.engines import EngineReports, TierLookup  # noqa: F401 - TierLookup is part of the API
from kvstore.client.locations import LocationCache
from kvstore.client.lookup_port import AsyncLookupPort, LookupPortClient, PortDown
from kvstore.client.reads import ReadCounts, Reads
from kvstore.client.shards import ShardedMeta, cluster_url
from kvstore.client.streams import LookupStream
from kvstore.client.writes import PutResult, Writes  # noqa: F401 - PutResult is part of the API
from kvstore.config import ClientConfig, default_host_id
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable, from_rpc_error
from kvstore.keys import KEY_BYTES, pack_keys
from kvstore.rpc import GRPC_OPTIONS
from kvstore.tls import TlsConfig, aio_channel, client_context, host_of
from kvstore.transport.shm import ShmTransport
from kvstore.transport.tcp import TcpTransport
from kvstore.v1 import meta_pb2, meta_pb2_grpc
from kvstore.wire import U8, Placement, unpack

log = logging.getLogger("kvstore.client")


# How often a client forgets mappings and connections of daemons that left.
PRUNE_S = 30.0
# Lookups of up to this many keys go on the lookup stream (kvstore.client.streams).
_STREAM_MAX_KEYS = 4096
_PORT_RETRY_S = 5.0  # after the lookup port failed, lookups stay on gRPC this long


class KVStoreClient(Reads, Writes, EngineReports):
    """Asyncio client. Create it inside a running loop; use ``async with`` or call ``close``."""

    def __init__(
        self, meta: str | None = None, config: ClientConfig | None = None, tls: TlsConfig | None = None
    ) -> None:
        self.cfg = config or ClientConfig()
        if meta:
            self.cfg.meta = meta
        if self.cfg.transport not in ("auto", "shm", "tcp"):
            raise InvalidArgument(f"client.transport must be auto, shm or tcp, got {self.cfg.transport!r}")
        self.host_id = self.cfg.host_id or default_host_id()
        cluster = cluster_url(self.cfg.meta)
        self._channel: grpc.aio.Channel | None = None
        self._lookups: LookupStream | None = None
        if cluster is not None:
            # A sharded cluster (kvstore.cluster): calls go to the shards that own their keys.
            self._stub: Any = ShardedMeta(*cluster, tls, self.cfg.token, self.cfg.rpc_timeout_s)
        else:
            self._channel = aio_channel(self.cfg.meta, tls, GRPC_OPTIONS, token=self.cfg.token)
            self._stub = meta_pb2_grpc.MetaServiceStub(self._channel)
            self._lookups = LookupStream(
                self._stub, lambda req: self._rpc(self._stub.Lookup, req), self.cfg.rpc_timeout_s
            )
        self._tls_on = tls is not None and tls.enabled
        self.lookup_port: LookupPortClient | None = None  # the service's lookup port, once advertised
        self._aport: AsyncLookupPort | None = None  # the same, for calls on this event loop
        self._port_ident: tuple[int, int] | None = None  # (port, instance id) adopted
        self._closing_port = False
        try:
            self._home: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._home = None
        self._port_retry_at = 0.0
        self._shm = ShmTransport()
        self._tcp = TcpTransport(
            self.cfg.io_timeout_s,
            client_context(tls) if tls is not None and tls.enabled else None,
            tls.server_name if tls is not None else "",
            sealed=tls is not None and tls.enabled and tls.sealed_records,
        )
        if self.cfg.io_threads < 1:
            raise InvalidArgument(f"client.io_threads must be at least 1, got {self.cfg.io_threads}")
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvstore-io")
        # Chunks of one batch; separate from _pool so that a batch waiting on its chunks never
        # holds the threads its chunks need.
        self._chunk_pool = ThreadPoolExecutor(
            max_workers=max(1, self.cfg.io_threads - 1), thread_name_prefix="kvstore-chunk"
        )
        self._pending: set[asyncio.Task] = set()
        self._pruned_at = time.monotonic()
        if self.cfg.location_cache < 0:
            raise InvalidArgument(f"client.location_cache must not be negative, got {self.cfg.location_cache}")
        self._known = LocationCache(self.cfg.location_cache)
        # Per data port: how many bytes one request may stage, as it last said (kvstore.daemon.staging).
        self._stage_bytes: dict[str, int] = {}
        # Chains read from known locations, for the next Touch (one in flight at a time).
        self._loop = asyncio.get_running_loop()
        self._touch_lock = threading.Lock()
        self._touches: deque[tuple[bytes, bytes]] = deque()  # (chain, the tier each block was read from)
        self._reads = ReadCounts()
        self._touch_keys = 0
        self._touching = False
        self._closing = False

    def _prune(self) -> None:
        """Every PRUNE_S: drops shared-memory mappings of segments that are gone or replaced
        and closes data-port connections idle for that long."""
        now = time.monotonic()
        if now - self._pruned_at >= PRUNE_S:
            self._pruned_at = now
            self._shm.prune()
            self._tcp.prune(PRUNE_S)

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        with self._touch_lock:
            self._closing = True  # reads from other threads queue no more Touch calls
        await self._send_touches()  # what waits for its delay goes now
        if self._lookups is not None:
            await self._lookups.close()
        self._closing_port = True  # no port is adopted after this
        port, self.lookup_port = self.lookup_port, None
        aport, self._aport = self._aport, None
        if port is not None:
            port.close()
        if aport is not None:
            aport.close()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
        else:
            await self._stub.close()
        self._pool.shutdown(wait=True)
        self._chunk_pool.shutdown(wait=True)
        self._tcp.close()
        self._shm.close()

    async def _rpc(self, method, request):  # noqa: ANN001
        try:
            return await method(request, timeout=self.cfg.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None

    # ---- reads ------------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes] | bytes) -> int:
        """How many leading keys are stored. No side effects (no lease, no recency update)."""
        resp = await self._lookup(meta_pb2.LookupRequest(keys=pack_keys(keys)))
        return resp.hit_count

    async def exists(self, keys: Sequence[bytes] | bytes) -> list[bool]:
        """Per key, whether it is stored (not only the leading run)."""
        packed = pack_keys(keys)
        resp = await self._lookup(meta_pb2.LookupRequest(keys=packed, per_key=True))
        return [bool(x) for x in unpack(resp.exists, U8, "exists", len(packed) // KEY_BYTES)]

    async def _lookup(self, request: meta_pb2.LookupRequest) -> meta_pb2.LookupResponse:
        """On the lookup stream; an empty or very large batch as a unary call, so that its error
        (or its size) is its own and not the stream's."""
        n = len(request.keys) // KEY_BYTES
        port = self._aport
        if port is not None and not (request.per_tier or request.with_locations) and port.usable(n):
            try:
                hit, exists = await port.ask(request.keys, request.per_key)
                return meta_pb2.LookupResponse(hit_count=hit, exists=exists)
            except PortDown as e:
                self.lookup_port_failed(str(e))
        if n == 0 or n > _STREAM_MAX_KEYS or self._lookups is None:
            resp = await self._rpc(self._stub.Lookup, request)
        else:
            resp = await self._lookups.ask(request)
        if resp.lookup_port and (
            self._port_ident is None or self._port_ident != (resp.lookup_port, resp.lookup_port_id)
        ):
            self._adopt_lookup_port(resp.lookup_port, resp.lookup_port_id)
        return resp

    def _adopt_lookup_port(self, port: int, instance: int) -> None:
        """Uses the lookup port the service advertised (kvstore.meta.lookup_port) for the sync
        facade's lookups: only with one service (not shards), no TLS and no token, and not for
        a while after it failed."""
        if not self.cfg.lookup_port or self._closing_port or self._lookups is None or self._tls_on or self.cfg.token:
            return
        if time.monotonic() < self._port_retry_at:
            return
        self.lookup_port_failed("the service advertised another lookup port")  # the old one, if any
        self._port_retry_at = 0.0
        host = host_of(self.cfg.meta)
        # Half the call's timeout on the port: a port that stops answering costs a caller half a
        # timeout before the same question goes over gRPC.
        timeout = self.cfg.rpc_timeout_s / 2
        self._port_ident = (port, instance)
        self.lookup_port = LookupPortClient(host, port, timeout, instance)
        self._aport = AsyncLookupPort(host, port, timeout, instance)

    def lookup_port_failed(self, why: str) -> None:
        """The lookup port could not answer: lookups go over gRPC for a while (the next gRPC
        answer that advertises the port after it brings it back)."""
        port, self.lookup_port = self.lookup_port, None
        aport, self._aport = self._aport, None
        self._port_ident = None
        if aport is not None:  # its transport belongs to the client's loop
            try:
                here = asyncio.get_running_loop()
            except RuntimeError:
                here = None
            if self._home is None or here is self._home:
                aport.close()
            elif not self._home.is_closed():
                try:
                    self._home.call_soon_threadsafe(aport.close)
                except RuntimeError:  # the loop closed meanwhile: its transports went with it
                    pass
        if port is not None:
            log.info("event=lookup_port_down reason=%r action=grpc_for_%gs", why, _PORT_RETRY_S)
            self._port_retry_at = time.monotonic() + _PORT_RETRY_S
            port.close()

    def _split(self, sizes: list[int]) -> list[tuple[int, int]]:
        """Contiguous index ranges of about equal bytes, one per I/O thread (one if small)."""
        total = sum(sizes)
        k = min(self.cfg.io_threads, len(sizes)) if total > INLINE_COPY_BYTES else 1
        if k <= 1:
            return [(0, len(sizes))]
        bounds, acc, lo = [], 0, 0
        for i, s in enumerate(sizes):
            acc += s
            if acc >= total * (len(bounds) + 1) / k and len(bounds) < k - 1:
                bounds.append((lo, i + 1))
                lo = i + 1
        bounds.append((lo, len(sizes)))
        return [b for b in bounds if b[0] < b[1]]

    def _background(self, method, request, event: str) -> None:  # noqa: ANN001
        """Sends one RPC without waiting for its answer (``close`` waits for it); a failure is
        logged as ``event``."""

        async def go() -> None:
            try:
                await method(request, timeout=self.cfg.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                log.info("event=%s code=%s", event, e.code().name)
            except KVStoreError as e:  # a sharded cluster's calls raise typed errors
                log.info("event=%s code=%s", event, e.code.name)

        task = asyncio.get_running_loop().create_task(go())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _use_shm(self, p: Placement) -> bool:
        """Shared memory for DRAM segments on this host; everything else (SSD blocks, which
        the daemon reads and verifies, and other hosts) through the data port."""
        if self.cfg.transport == "tcp" or p.segment.tier != 1:
            return False
        path = p.segment.shm_path
        usable = p.daemon.host_id == self.host_id and self._shm.usable(path, p.segment.capacity_bytes)
        if self.cfg.transport == "shm" and not usable:
            raise Unavailable(f"daemon {p.daemon.daemon_id} is not reachable through shared memory from this host")
        return usable

    # ---- management -------------------------------------------------------------------------

    async def remove(self, keys: Sequence[bytes] | bytes) -> int:
        """Removes stored keys; returns how many were removed. Leased bytes stay valid until
        their lease ends."""
        packed = pack_keys(keys)
        self._known.forget([packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)])
        return (await self._rpc(self._stub.Remove, meta_pb2.KeysRequest(keys=packed))).count

    async def pin(self, keys: Sequence[bytes] | bytes) -> int:
        """Keeps stored keys from eviction until unpinned; returns how many changed."""
        return (await self._rpc(self._stub.Pin, meta_pb2.KeysRequest(keys=pack_keys(keys)))).count

    async def unpin(self, keys: Sequence[bytes] | bytes) -> int:
        return (await self._rpc(self._stub.Unpin, meta_pb2.KeysRequest(keys=pack_keys(keys)))).count

    def location_stats(self) -> dict[str, int]:
        """Reads served from known locations (``hits``, in blocks), known locations found stale
        (``stale``), and locations known now (``known``)."""
        return {"hits": self._known.hits, "stale": self._known.stale, "known": len(self._known)}

    def read_stats(self) -> dict[str, int]:
        """What this client's gets loaded and missed, counted as the service counts its hits and
        misses (``hit_keys``, ``miss_keys``, ``hit_bytes``, ``dram_hit_keys``, ``ssd_hit_keys``;
        ``known_hit_keys``: loaded from known locations)."""
        return self._reads.snapshot()

    async def stats(self) -> meta_pb2.StatsResponse:
        return await self._rpc(self._stub.Stats, meta_pb2.StatsRequest())

    async def cluster_state(self) -> dict | None:
        """A sharded cluster's shards (slots, leader, address, epoch, keys, daemons) and members
        (each metadata process's role), from Redis and the shards; None without a cluster."""
        if not isinstance(self._stub, ShardedMeta):
            return None
        return await self._stub.state()

    async def advance_clock(self, seconds: float) -> float:
        """Skews the service's clock (only when started with ``meta.allow_clock_skew``)."""
        return (await self._rpc(self._stub.AdvanceClock, meta_pb2.AdvanceClockRequest(seconds=seconds))).now
