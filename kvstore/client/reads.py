"""The read path of :class:`kvstore.client.KVStoreClient` (a mixin over its state): a get
reads the blocks whose locations the client knows without the metadata service
(:mod:`kvstore.client.locations`), the rest through a lease (Acquire -> copy + verify ->
Release); same-host DRAM blocks through shared memory, SSD blocks of a same-host daemon through its
staging region, everything else over the data port. Reads from known locations are told to the
service in batches (``Touch``) for its cache policy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from kvstore.client.buffers import INLINE_COPY_BYTES, byte_views
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.extent import SSD_ALIGN, extent_size
from kvstore.keys import KEY_BYTES, key_list
from kvstore.transport.frames import DIRECT, STAGED, EntryStatus
from kvstore.transport.shm import ShmTransport
from kvstore.v1 import meta_pb2
from kvstore.wire import U32, Placement, locations_from_pb, pack

log = logging.getLogger("kvstore.client")

# Keys per Touch call, and the most that wait for one (see KVStoreClient._touch; how long the
# first waits for others to join it is client.touch_interval_s).
_TOUCH_BATCH_KEYS = 4096
_MAX_TOUCH_KEYS = 1 << 16
_SSD = 2  # kvstore.v1.Tier.TIER_SSD
# Shared-memory reads of blocks below this mean size are not split over the I/O threads.
SHM_SPLIT_BLOCK_BYTES = 256 << 10
# A staged request's bytes before the daemon said how many one request may stage.
_FIRST_REQUEST_BYTES = 4 << 20


def _views(keys: Sequence[bytes] | bytes, buffers: Sequence[Any]) -> tuple[list[bytes], list[np.ndarray]]:
    """A get's keys one by one, and its buffers as writable byte views (one per key)."""
    keys = key_list(keys)
    if len(buffers) != len(keys):
        raise InvalidArgument(f"get_into: {len(buffers)} buffers for {len(keys)} keys")
    return keys, byte_views(buffers, writable=True)


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


class ReadCounts:
    """What this client's gets loaded (``hit_keys``, ``hit_bytes``, by tier read) and missed,
    counted as the service counts them (kvstore.meta.reads): a get's keys once each, as loaded
    or not. ``known_hit_keys``: loaded from known locations, without the service on the path."""

    FIELDS = ("hit_keys", "miss_keys", "hit_bytes", "dram_hit_keys", "ssd_hit_keys", "known_hit_keys")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = dict.fromkeys(self.FIELDS, 0)

    def loaded(self, places: Sequence[Placement], known: bool = False) -> bytes:
        """Counts ``places`` as loaded; returns a byte per block, the tier it was read from."""
        tiers = bytes(p.segment.tier for p in places)
        ssd = tiers.count(_SSD)
        with self._lock:
            c = self._c
            c["hit_keys"] += len(places)
            c["hit_bytes"] += sum(p.length for p in places)
            c["ssd_hit_keys"] += ssd
            c["dram_hit_keys"] += len(places) - ssd
            if known:
                c["known_hit_keys"] += len(places)
        return tiers

    def missed(self, n: int) -> None:
        with self._lock:
            self._c["miss_keys"] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


def _segments(places: list[Placement]) -> dict[int, Placement]:
    """The distinct segment messages of ``places`` (by identity), each with its first placement:
    what is judged once per segment rather than once per block."""
    return {id(p.segment): p for p in places}


class Reads:
    """get_into and what it takes: known locations, leases, shared memory, the data port."""

    async def get_into(self, keys: Sequence[bytes] | bytes, buffers: Sequence[Any]) -> int:
        """Loads the longest stored prefix of ``keys`` into ``buffers`` (one per key).

        Returns how many leading blocks were loaded; each one's bytes were verified against
        its checksum. A checksum mismatch, a lost daemon or an expired lease ends the run
        there (a miss); blocks after the returned count may hold garbage in their buffers.
        Raises InvalidArgument if a buffer's size differs from its stored block's.
        """
        keys, dests = _views(keys, buffers)
        n = len(keys)
        self._prune()
        direct = await self._read_known_async(keys, dests)
        if direct == n:
            return n
        loaded = await self._get_rest(keys, dests, direct)  # a get that raises counts nowhere
        self._reads.missed(n - loaded)
        return loaded

    async def _get_rest(self, keys: list[bytes], dests: list[np.ndarray], direct: int) -> int:
        """Loads on from ``direct`` through leases (a second one where a block moved mid-read)."""
        loaded, moved = await self._get_leased(keys, dests, direct, False)
        if moved:
            # The block was not where the index said when the daemon came to it (a tier move or
            # a restart raced this read): the index has its new place, if it still has one. Not
            # there a second time, it is reported gone, so that the index forgets it.
            log.info("event=block_moved_mid_read index=%d action=acquire_again", loaded)
            try:
                loaded, _ = await self._get_leased(keys, dests, loaded, True)
            except KVStoreError as e:  # the blocks loaded so far stand: the rest is a miss
                log.info("event=acquire_again_failed loaded=%d reason=%r", loaded, str(e))
        return loaded

    async def _get_leased(
        self, keys: list[bytes], dests: list[np.ndarray], direct: int, report_gone: bool
    ) -> tuple[int, bool]:
        """Loads on from ``direct`` under a lease. Returns (leading blocks loaded in all, whether
        the run ended at a block its daemon did not hold there: worth asking again). With
        ``report_gone`` such a block is reported to the service like a corrupt one."""
        t0 = time.monotonic()
        rest = b"".join(keys[direct:])
        resp = await self._rpc(
            self._stub.Acquire,
            meta_pb2.AcquireRequest(keys=rest, ttl_ms=int(self.cfg.lease_ttl_s * 1000), host_id=self.host_id),
        )
        hit = resp.hit_count
        if hit == 0:
            return direct, False
        deadline = t0 + resp.ttl_ms / 1000.0
        places = locations_from_pb(resp.locations, hit)
        for i, p in enumerate(places, direct):
            if dests[i].size != p.length:
                self._release(resp.lease_id, [], unread=hit)
                raise InvalidArgument(f"buffers[{i}] holds {dests[i].size} bytes but block {i} is {p.length} bytes")
        keys = keys[direct : direct + hit]
        dests = dests[direct : direct + hit]
        total = sum(p.length for p in places)
        try:
            if total > INLINE_COPY_BYTES:
                loaded, corrupt, moved = await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._read_run, keys, places, dests, deadline
                )
            else:
                loaded, corrupt, moved = self._read_run(keys, places, dests, deadline)
        except BaseException:
            self._release(resp.lease_id, [], unread=hit)  # the lease goes now, not at its deadline
            raise
        again = loaded < hit and loaded in moved  # worth asking again (get_into does, once)
        self._release(
            resp.lease_id, corrupt + moved if report_gone else corrupt, hit - loaded, again and not report_gone
        )
        self._known.remember(keys[:loaded], places[:loaded], read=True)
        self._reads.loaded(places[:loaded])
        return direct + loaded, again

    def get_known(self, keys: Sequence[bytes] | bytes, buffers: Sequence[Any]) -> int:
        """Loads the leading run of ``keys`` whose locations this client knows, without the
        metadata service, in the calling thread (any thread: the sync client calls it in its
        callers' threads, with no hop to the event loop). Returns how many leading blocks were
        loaded, each verified; :meth:`get_into` reads on from there."""
        keys, dests = _views(keys, buffers)
        return self._read_known(keys, dests, self._known_run(keys, dests))

    def _known_run(self, keys: list[bytes], dests: list[np.ndarray]) -> list[Placement]:
        places = self._known.run(keys, self._shm_judge())
        if list(map(len, dests[: len(places)])) != [p.length for p in places]:
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
        shm = self._shm_judge()
        served: dict[str, bool] = {}
        gone: set[int] = set()  # segment messages of arenas no longer served
        segments = _segments(places)
        for seg, p in segments.items():
            if shm(p):
                path = p.segment.shm_path
                if path not in served:
                    served[path] = self._shm.arena(path, p.segment.capacity_bytes).served()
                if not served[path]:
                    gone.add(seg)
        if gone:
            i = next(i for i, p in enumerate(places) if id(p.segment) in gone)
            log.info("event=arena_not_served daemon=%s", places[i].daemon.daemon_id)
            places = places[:i]
            segments = _segments(places)
        if not places:
            return 0
        keys = keys[: len(places)]
        loaded, _, _ = self._read_run(keys, places, dests, float("inf"), True, segments)
        # Failures here are not reported as corrupt: without a lease the extent may simply
        # have been reused, which the checks caught. The leased path reads the block again.
        self._known.hits += loaded
        if loaded < len(places):
            self._known.stale += 1
            self._known.forget(keys[loaded : loaded + 1])
        if loaded:
            self._touch(b"".join(keys[:loaded]), self._reads.loaded(places[:loaded], known=True))
        return loaded

    async def _read_known_async(self, keys: list[bytes], dests: list[np.ndarray]) -> int:
        places = self._known_run(keys, dests)
        if sum(p.length for p in places) > INLINE_COPY_BYTES:
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

        def region(path: str, size: int, request_bytes: int, inode: int) -> Any:
            if path != expected:
                raise ValueError(f"staging region {path!r} is not the daemon's ({expected!r})")
            self._stage_bytes[addr] = request_bytes
            return self._shm.arena(path, size, inode)

        return region

    def _shm_ok(self, p: Placement) -> bool:
        try:
            return self._use_shm(p)
        except Unavailable:
            return False

    def _shm_judge(self, raising: bool = False) -> Callable[[Placement], bool]:
        """Whether placements are read through shared memory, decided once per segment message
        (one answer's placements share them): :meth:`_use_shm`, which raises where this client
        must use shared memory and cannot (``raising``), else :meth:`_shm_ok`."""
        judge = self._use_shm if raising else self._shm_ok
        memo: dict[int, bool] = {}

        def shm(p: Placement) -> bool:
            ok = memo.get(id(p.segment))
            if ok is None:
                ok = memo[id(p.segment)] = judge(p)
            return ok

        return shm

    def _touch(self, chain: bytes, tiers: bytes) -> None:
        """Queues a chain read from known locations for the next Touch (from any thread); the
        first waits ``client.touch_interval_s`` for others, one Touch is in flight at a time, and each takes
        everything queued meanwhile. Past ``_MAX_TOUCH_KEYS`` waiting (the service unreachable),
        the oldest are dropped: these are hints to the cache policy, not data."""
        with self._touch_lock:
            self._touches.append((chain, tiers))
            self._touch_keys += len(tiers)
            while self._touch_keys > _MAX_TOUCH_KEYS and len(self._touches) > 1:
                self._touch_keys -= len(self._touches.popleft()[1])
            if self._touching or self._closing:
                return
            self._touching = True
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._loop.call_later(self.cfg.touch_interval_s, self._start_touches)
        else:
            self._loop.call_soon_threadsafe(self._loop.call_later, self.cfg.touch_interval_s, self._start_touches)

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
                chains, tiers, n_keys = [], [], 0
                while self._touches and n_keys + len(self._touches[0][1]) <= _TOUCH_BATCH_KEYS:
                    c, t = self._touches.popleft()
                    n_keys += len(t)
                    chains.append(c)
                    tiers.append(t)
                if not chains:  # one chain longer than a batch: its head goes alone
                    c, t = self._touches.popleft()
                    n_keys = len(t)
                    chains, tiers = [c[: _TOUCH_BATCH_KEYS * KEY_BYTES]], [t[:_TOUCH_BATCH_KEYS]]
                self._touch_keys -= n_keys
            try:
                request = meta_pb2.TouchRequest(
                    chains=chains, interval_ms=round(self.cfg.touch_interval_s * 1000), tiers=b"".join(tiers)
                )
                await self._stub.Touch(request, timeout=self.cfg.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                log.info("event=touch_failed chains=%d code=%s", len(chains), e.code().name)
            except KVStoreError as e:  # a sharded cluster's calls raise typed errors
                log.info("event=touch_failed chains=%d code=%s", len(chains), e.code.name)

    def _read_run(
        self,
        keys: list[bytes],
        places: list[Placement],
        dests: list[np.ndarray],
        deadline: float,
        direct: bool = False,
        segments: dict[int, Placement] | None = None,
    ) -> tuple[int, list[int], list[int]]:
        """Copies the leased run, split over the I/O threads; the run ends at the first block
        that failed. Returns (blocks loaded, run indexes to report as corrupt, run indexes whose
        daemon did not hold the block where the lease said). ``segments``: :func:`_segments` of
        ``places``, where the caller has it."""
        if segments is None:
            segments = _segments(places)
        shm = self._shm_judge()
        single = len(segments) == 1
        sizes = [p.length for p in places]
        if sum(sizes) < SHM_SPLIT_BLOCK_BYTES * len(sizes) and all(shm(p) for p in segments.values()):
            # Small blocks read through shared memory go in one thread: without the native copy
            # each costs a few us of Python between two GIL-free calls (copy, checksum), and with
            # two threads every block hands the GIL over, which costs more than the second core
            # gives; with it, a run is one call and the second thread would halve the memory
            # bandwidth each gets for no gain at this size.
            ranges = [(0, len(places))]
        else:
            ranges = self._split(sizes)
        futs = [
            self._chunk_pool.submit(self._read_range, keys, places, dests, deadline, lo, hi, direct, single)
            for lo, hi in ranges[1:]
        ]
        results = [self._read_range(keys, places, dests, deadline, *ranges[0], direct, single)]
        results += [f.result() for f in futs]
        loaded = len(places)
        corrupt: list[int] = []
        moved: list[int] = []
        for (_lo, hi), (n, bad, gone) in zip(ranges, results):
            corrupt += bad
            moved += gone
            if n < hi and loaded == len(places):
                loaded = n
        return loaded, corrupt, moved

    def _read_range(
        self,
        keys: list[bytes],
        places: list[Placement],
        dests: list[np.ndarray],
        deadline: float,
        lo: int,
        hi: int,
        direct: bool = False,
        single: bool = False,
    ) -> tuple[int, list[int], list[int]]:
        """Copies blocks lo..hi in order and stops at the first that fails. Returns (index of the
        first block not loaded, indexes to report as corrupt, indexes not where the lease said:
        see :meth:`_read_run`). ``single``: all the placements
        share one segment message."""
        i = lo
        use_shm = self._shm_judge(raising=True)
        while i < hi:
            if time.monotonic() > deadline:
                log.info("event=lease_expired_mid_read loaded=%d of=%d", i, hi)
                return i, [], []
            p = places[i]
            if use_shm(p):
                # A run of consecutive blocks in one arena is copied in one loop (one call).
                j = hi if single else i + 1
                while j < hi and places[j].segment is p.segment:
                    j += 1
                arena = self._shm.arena(p.segment.shm_path, p.segment.capacity_bytes)
                # Without a lease (direct) the extent's header must name the block around the copy.
                n = i + ShmTransport.read_many(arena, places[i:j], dests[i:j], keys[i:j] if direct else None, deadline)
                if n < j:
                    if time.monotonic() > deadline:
                        log.info("event=lease_expired_mid_read loaded=%d of=%d", n, hi)
                        return n, [], []
                    if direct:
                        log.debug("event=stale_location transport=shm daemon=%s index=%d", p.daemon.daemon_id, n)
                    else:
                        log.warning("event=checksum_mismatch transport=shm daemon=%s index=%d", p.daemon.daemon_id, n)
                    return n, [n], []
                i = j
                continue
            # A run of consecutive blocks on the same daemon goes in one TCP request.
            j = i
            while j < hi and places[j].daemon.daemon_id == p.daemon.daemon_id and not use_shm(places[j]):
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
            # Staged reads go in requests that fit what the daemon stages per request (its
            # staging is reused only between requests); anything beyond would stream. They go
            # pipelined, two in flight on one connection.
            parts = [(i, j)]
            if staging is not None:
                flags |= STAGED
                parts = _fit(places, i, j, self._stage_bytes.get(p.daemon.data_addr, _FIRST_REQUEST_BYTES))
            done, err = self._tcp.read_parts(
                p.daemon.data_addr, [(items[a - i : b - i], dests[a:b]) for a, b in parts], flags, staging
            )
            for (a, _b), statuses in zip(parts, done):
                for k, st in enumerate(statuses):
                    if st == EntryStatus.OK:
                        continue
                    n = a + k
                    if st != EntryStatus.CHECKSUM:
                        # Not there (moved on, dropped; an I/O error is the daemon's to handle):
                        # a miss here, nothing to report. Bytes that fail their checksum, as the
                        # daemon read them or as they arrived, are reported: the replica goes.
                        log.info(
                            "event=block_not_there transport=tcp daemon=%s index=%d status=%d",
                            p.daemon.daemon_id,
                            n,
                            st,
                        )
                        return n, [], ([] if direct else [n])
                    level = logging.DEBUG if direct else logging.WARNING
                    log.log(level, "event=block_rejected transport=tcp daemon=%s index=%d", p.daemon.daemon_id, n)
                    return n, [n], []
            if err is not None:
                log.info("event=daemon_unreachable daemon=%s reason=%r", p.daemon.daemon_id, str(err))
                return parts[len(done)][0], [], []
            i = j
        return hi, [], []

    def _release(self, lease_id: int, corrupt: list[int], unread: int = 0, asked_again: bool = False) -> None:
        """Ends a lease without waiting for the answer (the lease would lapse anyway). ``unread``:
        the run's last blocks that were not loaded (the service counts them as misses unless
        ``asked_again``: the Acquire that asks them again counts them)."""
        req = meta_pb2.ReleaseRequest(
            lease_id=lease_id, corrupt=pack(corrupt, U32), unread=unread, asked_again=asked_again
        )
        self._background(self._stub.Release, req, f"release_failed lease={lease_id}")
