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
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import grpc
import numpy as np

from kvstore.client.buffers import byte_view
from kvstore.client.locations import LocationCache
from kvstore.client.streams import LookupStream
from kvstore.config import ClientConfig, default_host_id
from kvstore.errors import InvalidArgument, KVStoreError, ResourceExhausted, Unavailable, from_rpc_error
from kvstore.extent import SSD_ALIGN, checksum, extent_size
from kvstore.keys import KEY_BYTES, pack_keys
from kvstore.rpc import GRPC_OPTIONS
from kvstore.tls import TlsConfig, aio_channel, client_context
from kvstore.transport.frames import DIRECT, STAGED
from kvstore.transport.shm import ShmTransport
from kvstore.transport.tcp import TcpTransport
from kvstore.v1 import common_pb2, meta_pb2, meta_pb2_grpc
from kvstore.wire import U8, U32, U64, Placement, locations_from_pb, pack, unpack

log = logging.getLogger("kvstore.client")

# Copies larger than this run in a worker thread so the event loop stays responsive, and are
# split over ``client.io_threads`` threads (memcpy and xxh3 release the GIL).
_INLINE_COPY_BYTES = 8 << 20


# How often a client forgets mappings and connections of daemons that left.
PRUNE_S = 30.0
# Keys per Touch call, the most that wait for one, and how long the first waits for others to
# join it (see KVStoreClient._touch): a cache policy needs no finer time than that.
_TOUCH_BATCH_KEYS = 4096
_MAX_TOUCH_KEYS = 1 << 16
_TOUCH_DELAY_S = 0.05
# A staged request's bytes before the daemon said what its slices hold.
_FIRST_SLICE_BYTES = 4 << 20


def _fit(places: list[Placement], lo: int, hi: int, budget: int) -> list[tuple[int, int]]:
    """Index ranges of ``places[lo:hi]`` whose extents add up to at most ``budget`` bytes (one
    block at least per range)."""
    out, start, acc = [], lo, 0
    for k in range(lo, hi):
        size = extent_size(places[k].length, SSD_ALIGN)
        if k > start and acc + size > budget:
            out.append((start, k))
            start, acc = k, 0
        acc += size
    out.append((start, hi))
    return out


# Lookups of up to this many keys go on the lookup stream (kvstore.client.streams).
_STREAM_MAX_KEYS = 4096


class PutResult(NamedTuple):
    stored: int  # newly written and committed
    skipped: int  # already stored or being written by someone else (dedup)
    rejected: int  # no space even after eviction, or not admitted by the cache policy


class KVStoreClient:
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
        self._channel = aio_channel(self.cfg.meta, tls, GRPC_OPTIONS, token=self.cfg.token)
        self._stub = meta_pb2_grpc.MetaServiceStub(self._channel)
        self._lookups = LookupStream(self._stub, lambda req: self._rpc(self._stub.Lookup, req), self.cfg.rpc_timeout_s)
        self._shm = ShmTransport()
        self._tcp = TcpTransport(
            self.cfg.io_timeout_s,
            client_context(tls) if tls is not None and tls.enabled else None,
            tls.server_name if tls is not None else "",
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
        # Per data port: the size of its staging slices, as it last said (kvstore.daemon.staging).
        self._slice_bytes: dict[str, int] = {}
        # Chains read from known locations, for the next Touch (one in flight at a time).
        self._loop = asyncio.get_running_loop()
        self._touch_lock = threading.Lock()
        self._touches: deque[bytes] = deque()
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
        await self._lookups.close()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        await self._channel.close()
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
        if n == 0 or n > _STREAM_MAX_KEYS:
            return await self._rpc(self._stub.Lookup, request)
        return await self._lookups.ask(request)

    async def get_into(self, keys: Sequence[bytes] | bytes, buffers: Sequence[Any]) -> int:
        """Loads the longest stored prefix of ``keys`` into ``buffers`` (one per key).

        Returns how many leading blocks were loaded; each one's bytes were verified against
        its checksum. A checksum mismatch, a lost daemon or an expired lease ends the run
        there (a miss); blocks after the returned count may hold garbage in their buffers.
        Raises InvalidArgument if a buffer's size differs from its stored block's.
        """
        packed = pack_keys(keys)
        n = len(packed) // KEY_BYTES
        if len(buffers) != n:
            raise InvalidArgument(f"get_into: {len(buffers)} buffers for {n} keys")
        dests = [byte_view(b, writable=True, what=f"buffers[{i}]") for i, b in enumerate(buffers)]
        self._prune()
        key_list = [packed[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in range(n)]
        direct = await self._read_known_async(key_list, dests)
        if direct == n:
            return n
        t0 = time.monotonic()
        rest = packed[direct * KEY_BYTES :]
        resp = await self._rpc(
            self._stub.Acquire,
            meta_pb2.AcquireRequest(keys=rest, ttl_ms=int(self.cfg.lease_ttl_s * 1000), host_id=self.host_id),
        )
        hit = resp.hit_count
        if hit == 0:
            return direct
        deadline = t0 + resp.ttl_ms / 1000.0
        places = locations_from_pb(resp.locations, hit)
        for i, p in enumerate(places, direct):
            if dests[i].size != p.length:
                self._release(resp.lease_id, [])
                raise InvalidArgument(f"buffers[{i}] holds {dests[i].size} bytes but block {i} is {p.length} bytes")
        key_list = key_list[direct : direct + hit]
        dests = dests[direct : direct + hit]
        total = sum(p.length for p in places)
        try:
            if total > _INLINE_COPY_BYTES:
                loaded, corrupt = await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._read_run, key_list, places, dests, deadline
                )
            else:
                loaded, corrupt = self._read_run(key_list, places, dests, deadline)
        except BaseException:
            self._release(resp.lease_id, [])  # the lease goes now, not at its deadline
            raise
        self._release(resp.lease_id, corrupt)
        self._known.remember(key_list[:loaded], places[:loaded], read=True)
        return direct + loaded

    def get_known(self, keys: Sequence[bytes] | bytes, buffers: Sequence[Any]) -> int:
        """Loads the leading run of ``keys`` whose locations this client knows, without the
        metadata service, in the calling thread (any thread: the sync client calls it in its
        callers' threads, with no hop to the event loop). Returns how many leading blocks were
        loaded, each verified; :meth:`get_into` reads on from there."""
        packed = pack_keys(keys)
        n = len(packed) // KEY_BYTES
        if len(buffers) != n:
            raise InvalidArgument(f"get_into: {len(buffers)} buffers for {n} keys")
        dests = [byte_view(b, writable=True, what=f"buffers[{i}]") for i, b in enumerate(buffers)]
        key_list = [packed[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in range(n)]
        return self._read_known(key_list, dests, self._known_run(key_list, dests))

    def _known_run(self, keys: list[bytes], dests: list[np.ndarray]) -> list[Placement]:
        places = self._known.run(keys, self._shm_ok)
        for i, p in enumerate(places):
            if dests[i].size != p.length:  # let the leased path judge (and raise) from here on
                return places[:i]
        return places

    def _read_known(self, keys: list[bytes], dests: list[np.ndarray], places: list[Placement]) -> int:
        """Reads ``places`` (the known run of ``keys``) without a lease. Returns how many leading
        blocks were loaded; the first that failed (it moved on, or its daemon is gone) is
        forgotten, and the caller reads on from there through a lease."""
        # A daemon that died or drains no longer serves its arena: its blocks are misses. Checked
        # once per call, so that a read that started before a drain completes.
        served: dict[str, bool] = {}
        for i, p in enumerate(places):
            if self._shm_ok(p):
                path = p.segment.shm_path
                if path not in served:
                    served[path] = self._shm.arena(path, p.segment.capacity_bytes).served()
                if not served[path]:
                    log.info("event=arena_not_served daemon=%s", p.daemon.daemon_id)
                    places = places[:i]
                    break
        if not places:
            return 0
        keys = keys[: len(places)]
        loaded, _ = self._read_run(keys, places, dests, float("inf"), True)
        # Failures here are not reported as corrupt: without a lease the extent may simply
        # have been reused, which the checks caught. The leased path reads the block again.
        self._known.hits += loaded
        if loaded < len(places):
            self._known.stale += 1
            self._known.forget(keys[loaded : loaded + 1])
        if loaded:
            self._touch(b"".join(keys[:loaded]), loaded)
        return loaded

    async def _read_known_async(self, keys: list[bytes], dests: list[np.ndarray]) -> int:
        places = self._known_run(keys, dests)
        if sum(p.length for p in places) > _INLINE_COPY_BYTES:
            return await self._loop.run_in_executor(self._pool, self._read_known, keys, dests, places)
        return self._read_known(keys, dests, places)

    def _staging_of(self, p: Placement) -> Any:
        """For a daemon on this host whose shared memory this process may map: a function that
        maps its staging region (kvstore.daemon.staging), only at the path next to its DRAM
        segment, so that no answer can make this client map another file. None: stream instead."""
        if self.cfg.transport != "auto" or p.daemon.host_id != self.host_id:
            return None
        dram = next((s for s in p.daemon.segments if s.tier == 1 and s.shm_path.endswith("-dram")), None)
        if dram is None or not self._shm.usable(dram.shm_path, dram.capacity_bytes):
            return None
        expected = dram.shm_path[: -len("-dram")] + "-staging"
        addr = p.daemon.data_addr

        def region(path: str, size: int, slice_bytes: int) -> Any:
            if path != expected:
                raise ValueError(f"staging region {path!r} is not the daemon's ({expected!r})")
            self._slice_bytes[addr] = slice_bytes
            return self._shm.arena(path, size)

        return region

    def _shm_ok(self, p: Placement) -> bool:
        try:
            return self._use_shm(p)
        except Unavailable:
            return False

    def _touch(self, chain: bytes, n: int) -> None:
        """Queues a chain read from known locations for the next Touch (from any thread); the
        first waits ``_TOUCH_DELAY_S`` for others, one Touch is in flight at a time, and each takes
        everything queued meanwhile. Past 64 Ki keys
        waiting (the service unreachable), the oldest are dropped: these are hints to the cache
        policy, not data."""
        with self._touch_lock:
            self._touches.append(chain)
            self._touch_keys += n
            while self._touch_keys > _MAX_TOUCH_KEYS and len(self._touches) > 1:
                self._touch_keys -= len(self._touches.popleft()) // KEY_BYTES
            if self._touching or self._closing:
                return
            self._touching = True
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._loop.call_later(_TOUCH_DELAY_S, self._start_touches)
        else:
            self._loop.call_soon_threadsafe(self._loop.call_later, _TOUCH_DELAY_S, self._start_touches)

    def _start_touches(self) -> None:
        if self._closing:  # close() sent them
            return
        task = self._loop.create_task(self._send_touches())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send_touches(self) -> None:
        while True:
            with self._touch_lock:
                if not self._touches:
                    self._touching = False
                    return
                chains, n_keys = [], 0
                while self._touches and n_keys + len(self._touches[0]) // KEY_BYTES <= _TOUCH_BATCH_KEYS:
                    c = self._touches.popleft()
                    n_keys += len(c) // KEY_BYTES
                    chains.append(c)
                if not chains:  # one chain longer than a batch: its head goes alone
                    c = self._touches.popleft()
                    n_keys = len(c) // KEY_BYTES
                    chains = [c[: _TOUCH_BATCH_KEYS * KEY_BYTES]]
                self._touch_keys -= n_keys
            try:
                await self._stub.Touch(meta_pb2.TouchRequest(chains=chains), timeout=self.cfg.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                log.info("event=touch_failed chains=%d code=%s", len(chains), e.code().name)

    def _split(self, sizes: list[int]) -> list[tuple[int, int]]:
        """Contiguous index ranges of about equal bytes, one per I/O thread (one if small)."""
        total = sum(sizes)
        k = min(self.cfg.io_threads, len(sizes)) if total > _INLINE_COPY_BYTES else 1
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

    def _read_run(
        self, keys: list[bytes], places: list[Placement], dests: list[np.ndarray], deadline: float, direct: bool = False
    ) -> tuple[int, list[int]]:
        """Copies the leased run, split over the I/O threads; the run ends at the first block
        that failed. Returns (blocks loaded, run indexes to report as corrupt)."""
        ranges = self._split([p.length for p in places])
        futs = [
            self._chunk_pool.submit(self._read_range, keys, places, dests, deadline, lo, hi, direct)
            for lo, hi in ranges[1:]
        ]
        results = [self._read_range(keys, places, dests, deadline, *ranges[0], direct)] + [f.result() for f in futs]
        loaded = len(places)
        corrupt: list[int] = []
        for (_lo, hi), (n, bad) in zip(ranges, results):
            corrupt += bad
            if n < hi and loaded == len(places):
                loaded = n
        return loaded, corrupt

    def _read_range(
        self,
        keys: list[bytes],
        places: list[Placement],
        dests: list[np.ndarray],
        deadline: float,
        lo: int,
        hi: int,
        direct: bool = False,
    ) -> tuple[int, list[int]]:
        """Copies blocks lo..hi in order and stops at the first that fails. Returns (index of the
        first block not loaded, indexes to report as corrupt)."""
        i = lo
        while i < hi:
            if time.monotonic() > deadline:
                log.info("event=lease_expired_mid_read loaded=%d of=%d", i, hi)
                return i, []
            p = places[i]
            if self._use_shm(p):
                arena = self._shm.arena(p.segment.shm_path, p.segment.capacity_bytes)
                # Without a lease (direct) the extent's header must name the block around the copy.
                named = (p.key or keys[i]) if direct else b""
                if not ShmTransport.read(arena, p.offset, p.length, dests[i], p.checksum, named, p.gen):
                    if direct:
                        log.debug("event=stale_location transport=shm daemon=%s index=%d", p.daemon.daemon_id, i)
                    else:
                        log.warning("event=checksum_mismatch transport=shm daemon=%s index=%d", p.daemon.daemon_id, i)
                    return i, [i]
                i += 1
                continue
            # A run of consecutive blocks on the same daemon goes in one TCP request.
            j = i
            while j < hi and places[j].daemon.daemon_id == p.daemon.daemon_id and not self._use_shm(places[j]):
                j += 1
            items = [
                (
                    places[k].key or keys[k],
                    places[k].segment_id,
                    places[k].offset,
                    places[k].length,
                    places[k].checksum,
                    places[k].gen,
                    places[k].ticket,
                )
                for k in range(i, j)
            ]
            flags = DIRECT if direct else 0
            staging = self._staging_of(p)
            # Staged reads go in requests that fit the daemon's staging slice (it is reused only
            # between requests); anything beyond would stream.
            parts = [(i, j)]
            if staging is not None:
                flags |= STAGED
                parts = _fit(places, i, j, self._slice_bytes.get(p.daemon.data_addr, _FIRST_SLICE_BYTES))
            for a, b in parts:
                try:
                    ok = self._tcp.read(p.daemon.data_addr, items[a - i : b - i], dests[a:b], flags, staging)
                except (Unavailable, InvalidArgument) as e:
                    log.info("event=daemon_unreachable daemon=%s reason=%r", p.daemon.daemon_id, str(e))
                    return a, []
                for k, good in enumerate(ok):
                    if not good:
                        level = logging.DEBUG if direct else logging.WARNING
                        log.log(
                            level, "event=block_rejected transport=tcp daemon=%s index=%d", p.daemon.daemon_id, a + k
                        )
                        return a + k, [a + k]
            i = j
        return hi, []

    def _abort(self, put_id: int) -> None:
        """Gives a put's reservation back without waiting for the answer."""
        self._background(self._stub.PutAbort, meta_pb2.PutAbortRequest(put_id=put_id), f"abort_failed put={put_id}")

    def _release(self, lease_id: int, corrupt: list[int]) -> None:
        """Ends a lease without waiting for the answer (the lease would lapse anyway)."""
        req = meta_pb2.ReleaseRequest(lease_id=lease_id, corrupt=pack(corrupt, U32))
        self._background(self._stub.Release, req, f"release_failed lease={lease_id}")

    def _background(self, method, request, event: str) -> None:  # noqa: ANN001
        """Sends one RPC without waiting for its answer (``close`` waits for it); a failure is
        logged as ``event``."""

        async def go() -> None:
            try:
                await method(request, timeout=self.cfg.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                log.info("event=%s code=%s", event, e.code().name)

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

    # ---- writes -----------------------------------------------------------------------------

    async def put(self, keys: Sequence[bytes] | bytes, buffers: Sequence[Any], *, chain: bool = True) -> PutResult:
        """Stores blocks; keys already stored (or being stored) are skipped.

        ``chain``: the keys are one prefix chain in order (the usual case), which lets the
        service keep a chain's head longer than its tail. A daemon that fails mid-write is
        excluded and its blocks are placed elsewhere (``client.retries`` times).
        """
        packed = pack_keys(keys)
        n = len(packed) // KEY_BYTES
        if len(buffers) != n:
            raise InvalidArgument(f"put: {len(buffers)} buffers for {n} keys")
        srcs = [byte_view(b, writable=False, what=f"buffers[{i}]") for i, b in enumerate(buffers)]
        for i, s in enumerate(srcs):
            if s.size == 0:
                raise InvalidArgument(f"buffers[{i}] is empty: blocks must hold at least one byte")
        self._prune()
        stored = skipped = rejected = no_space = 0
        todo = list(range(n))
        excluded: list[str] = []
        for attempt in range(self.cfg.retries + 1):
            sub = b"".join(packed[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in todo)
            resp = await self._rpc(
                self._stub.PutStart,
                meta_pb2.PutStartRequest(
                    keys=sub,
                    sizes=pack([srcs[i].size for i in todo], U64),
                    chain=chain and attempt == 0,
                    host_id=self.host_id,
                    timeout_ms=int(self.cfg.put_timeout_s * 1000),
                    exclude_daemons=excluded,
                ),
            )
            status = unpack(resp.status, U8, "status", len(todo))
            skipped += sum(1 for s in status if s in (1, 2))
            rejected += sum(1 for s in status if s in (3, 4))  # no space, or not admitted by the policy
            alloc = [todo[k] for k, s in enumerate(status) if s == 0]
            if not alloc:
                break
            places = locations_from_pb(resp.placements, len(alloc))
            total = sum(srcs[i].size for i in alloc)
            args = (packed, alloc, places, srcs)
            try:
                if total > _INLINE_COPY_BYTES:
                    sums, written, failed = await asyncio.get_running_loop().run_in_executor(
                        self._pool, self._write_all, *args
                    )
                else:
                    sums, written, failed = self._write_all(*args)
            except BaseException:
                self._abort(resp.put_id)  # the reservation goes now, not at its deadline
                raise
            commit = await self._rpc(
                self._stub.PutCommit,
                meta_pb2.PutCommitRequest(put_id=resp.put_id, checksums=pack(sums, U64), written=pack(written, U8)),
            )
            stored += commit.committed
            outcome = unpack(commit.status, U8, "status", len(alloc)) if commit.status else [0] * len(alloc)
            ok = [k for k, st in enumerate(outcome) if st == common_pb2.COMMIT_OK]
            self._known.remember(
                [packed[alloc[k] * KEY_BYTES : (alloc[k] + 1) * KEY_BYTES] for k in ok],
                [places[k] for k in ok],
                read=False,
            )
            full = outcome.count(common_pb2.COMMIT_NO_SPACE)
            no_space += full
            rejected += full
            # Not written, or its daemon could not commit it: try again on another daemon.
            todo = [i for i, st in zip(alloc, outcome) if st not in (common_pb2.COMMIT_OK, common_pb2.COMMIT_NO_SPACE)]
            if not todo:
                break
            lost = (common_pb2.COMMIT_MISMATCH, common_pb2.COMMIT_UNAVAILABLE)
            failed += [p.daemon.daemon_id for p, st in zip(places, outcome) if st in lost]
            excluded.extend(d for d in dict.fromkeys(failed) if d not in excluded)
            log.info("event=put_retry blocks=%d excluded=%s", len(todo), ",".join(excluded))
        else:
            if todo:
                raise Unavailable(f"put: {len(todo)} blocks could not be written after {self.cfg.retries + 1} attempts")
        if no_space and not stored and not skipped:
            raise ResourceExhausted(f"put: no space to store {no_space} blocks (a daemon's storage is full)")
        return PutResult(stored, skipped, rejected)

    def _write_all(
        self, packed: bytes, alloc: list[int], places: list[Placement], srcs: list[np.ndarray]
    ) -> tuple[list[int], list[int], list[str]]:
        """Writes the allocated blocks, split over the I/O threads. Returns (checksums,
        written flags, daemons that failed), all in placement order."""
        ranges = self._split([p.length for p in places])
        args = (packed, alloc, places, srcs)
        futs = [self._chunk_pool.submit(self._write_range, *args, lo, hi) for lo, hi in ranges[1:]]
        parts = [self._write_range(*args, *ranges[0])] + [f.result() for f in futs]
        sums = [c for part in parts for c in part[0]]
        written = [w for part in parts for w in part[1]]
        failed = sorted({d for part in parts for d in part[2]})
        return sums, written, failed

    def _write_range(
        self, packed: bytes, alloc: list[int], places: list[Placement], srcs: list[np.ndarray], lo: int, hi: int
    ) -> tuple[list[int], list[int], list[str]]:
        sums = []
        written = [0] * (hi - lo)
        failed: list[str] = []
        tcp_groups: dict[str, list[int]] = {}
        for k in range(lo, hi):
            i, p = alloc[k], places[k]
            src = srcs[i]
            csum = checksum(src)
            sums.append(csum)
            if self._use_shm(p):
                arena = self._shm.arena(p.segment.shm_path, p.segment.capacity_bytes)
                written[k - lo] = int(ShmTransport.write(arena, p.offset, src))
            else:
                tcp_groups.setdefault(p.daemon.data_addr, []).append(k)
        for addr, ks in tcp_groups.items():
            items = [
                (places[k].key or packed[alloc[k] * KEY_BYTES : (alloc[k] + 1) * KEY_BYTES], places[k].segment_id,
                 places[k].offset, places[k].length, sums[k - lo], places[k].gen, places[k].ticket)
                for k in ks
            ]  # fmt: skip
            try:
                ok = self._tcp.write(addr, items, [srcs[alloc[k]] for k in ks])
            except KVStoreError as e:
                log.info("event=write_failed addr=%s reason=%r", addr, str(e))
                failed.append(places[ks[0]].daemon.daemon_id)
                continue
            for k, good in zip(ks, ok):
                written[k - lo] = int(good)
        return sums, written, failed

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

    async def stats(self) -> meta_pb2.StatsResponse:
        return await self._rpc(self._stub.Stats, meta_pb2.StatsRequest())

    async def advance_clock(self, seconds: float) -> float:
        """Skews the service's clock (only when started with ``meta.allow_clock_skew``)."""
        return (await self._rpc(self._stub.AdvanceClock, meta_pb2.AdvanceClockRequest(seconds=seconds))).now
