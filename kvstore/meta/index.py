"""The cluster index: which blocks exist, where their replicas are, who holds them.

Pure state and policy: no I/O, no gRPC, time from an injected :class:`Clock`; the service
(:mod:`kvstore.meta.service`) is a thin adapter over it. One event loop owns it, so no locks.

Replica life cycle::

    PutStart -> PENDING (extent reserved, invisible) --PutCommit--> COMPLETE (visible, evictable)
                   |                                                   |
                   +-- PutAbort / deadline / daemon lost --> freed     +-- evict / Remove /
                                                                           corrupt / daemon lost --> freed

Eviction is per segment, least recently used first, over COMPLETE replicas that are neither
leased nor pinned (those are not in the LRU at all, so they can never be picked). Every access
touches a chain's keys from tail to head, so a chain's head is always more recent than its tail
and the tail is dropped first: a block is worthless without its predecessors.
"""

from __future__ import annotations

import itertools
import math
import random
import struct
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from kvstore.errors import Expired, InvalidArgument, NotFound, ResourceExhausted
from kvstore.extent import extent_size
from kvstore.keys import KEY_BYTES, unpack_keys
from kvstore.meta.allocator import Allocator


class Clock:
    """Monotonic seconds, plus a skew that tests may advance (``AdvanceClock``)."""

    def __init__(self) -> None:
        self.skew = 0.0

    def now(self) -> float:
        return time.monotonic() + self.skew

    def advance(self, seconds: float) -> float:
        self.skew += seconds
        return self.now()


class Tier(IntEnum):  # mirrors kvstore.v1.Tier
    DRAM = 1
    SSD = 2
    GPU = 3


class PutStatus(IntEnum):  # mirrors kvstore.v1.PutStatus
    ALLOCATED = 0
    SKIP_EXISTS = 1
    SKIP_INFLIGHT = 2
    NO_SPACE = 3


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    segment_id: int
    tier: Tier
    capacity: int
    shm_path: str = ""


@dataclass(frozen=True, slots=True)
class DaemonSpec:
    daemon_id: str
    host_id: str
    data_addr: str
    control_addr: str
    segments: tuple[SegmentSpec, ...]


class InventoryItem(NamedTuple):
    key: bytes
    offset: int
    length: int
    checksum: int


ROW = struct.Struct("<IIQQQ")  # segment ref | reserved | offset | length | checksum (common.proto)


class Replica:
    __slots__ = ("segment", "offset", "size", "length", "checksum", "leases", "entry", "live", "row")

    def __init__(self, segment: Segment, offset: int, size: int, length: int, entry: Entry) -> None:
        self.segment = segment
        self.offset = offset
        self.size = size  # extent bytes in the segment
        self.length = length  # payload bytes
        self.checksum = 0
        self.leases = 0
        self.entry = entry
        self.live = True  # False once dropped from the index (freed when the last lease goes)
        self.row = ROW.pack(segment.ref, 0, offset, length, 0)

    def set_checksum(self, csum: int) -> None:
        self.checksum = csum
        self.row = ROW.pack(self.segment.ref, 0, self.offset, self.length, csum)


class Entry:
    __slots__ = ("key", "complete", "replica", "pinned", "put_id")

    def __init__(self, key: bytes, put_id: int) -> None:
        self.key = key
        self.complete = False
        self.replica: Replica | None = None
        self.pinned = False
        self.put_id = put_id


class Segment:
    __slots__ = ("daemon", "spec", "alloc", "lru", "blocks", "pinned", "leased", "ref")

    def __init__(self, daemon: Daemon, spec: SegmentSpec, ref: int, alloc: Allocator | None = None) -> None:
        self.daemon = daemon
        self.ref = ref  # names this segment in location rows
        self.spec = spec
        self.alloc = alloc or Allocator(spec.capacity)
        # Evictable replicas only, oldest first.
        self.lru: OrderedDict[bytes, Replica] = OrderedDict()
        self.blocks = 0
        self.pinned = 0
        self.leased = 0


@dataclass(slots=True)
class Daemon:
    spec: DaemonSpec
    deadline: float
    last_heartbeat: float
    segments: dict[int, Segment] = field(default_factory=dict)
    # (segment_id, key, offset) of freed extents whose header the daemon must clear.
    invalidations: list[tuple[int, bytes, int]] = field(default_factory=list)


@dataclass(slots=True)
class Put:
    put_id: int
    deadline: float
    keys: list[bytes]  # the whole request, for touching the chain on commit
    entries: list[Entry]  # the allocated ones, in placement order


@dataclass(slots=True)
class Lease:
    lease_id: int
    deadline: float
    replicas: list[Replica]


class PutStartResult(NamedTuple):
    put_id: int
    status: list[int]
    placements: list[Replica]
    deadline: float


class AcquireResult(NamedTuple):
    hit_count: int
    lease_id: int
    locations: list[Replica]
    ttl: float


@dataclass(frozen=True, slots=True)
class IndexLimits:
    max_batch_keys: int = 16384
    max_block_bytes: int = 1 << 30
    put_timeout_s: float = 30.0
    max_put_timeout_s: float = 600.0
    lease_ttl_s: float = 10.0
    max_lease_ttl_s: float = 300.0
    daemon_ttl_s: float = 3.0
    heartbeat_interval_s: float = 0.5


class Index:
    """The metadata service's state. Every public method validates its input first and changes
    nothing when it raises."""

    def __init__(self, limits: IndexLimits | None = None, clock: Clock | None = None) -> None:
        self.limits = limits or IndexLimits()
        self.clock = clock or Clock()
        self.entries: dict[bytes, Entry] = {}
        self.daemons: dict[str, Daemon] = {}
        self.puts: dict[int, Put] = {}
        self.leases: dict[int, Lease] = {}
        # Ids start at a random point so that ids from before a restart are never reused.
        base = random.getrandbits(62)
        self._put_ids = itertools.count(base)
        self._lease_ids = itertools.count(base)
        self._segment_refs = itertools.count(1)
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "lookups",
                "lookup_keys",
                "lookup_hit_keys",
                "acquires",
                "hit_keys",
                "miss_keys",
                "hit_bytes",
                "puts",
                "put_keys",
                "put_bytes",
                "dedup_keys",
                "no_space_keys",
                "evictions",
                "evicted_bytes",
                "removed",
                "expired_puts",
                "expired_leases",
                "corrupt_reported",
                "daemons_lost",
            ),
            0,
        )

    # ---- validation -------------------------------------------------------------------------

    def _keys(self, packed: bytes, what: str = "keys") -> list[bytes]:
        if len(packed) % KEY_BYTES:
            raise InvalidArgument(
                f"{what}: packed keys must be a multiple of {KEY_BYTES} bytes, got {len(packed)} bytes"
            )
        n = len(packed) // KEY_BYTES
        if n == 0:
            raise InvalidArgument(f"{what}: empty batch")
        if n > self.limits.max_batch_keys:
            raise InvalidArgument(f"{what}: batch of {n} keys is over the limit of {self.limits.max_batch_keys}")
        return unpack_keys(packed)

    def _timeout(self, value_s: float, default: float, limit: float, what: str) -> float:
        if math.isnan(value_s):
            raise InvalidArgument(f"{what} must be a finite number, got {value_s}")
        if value_s < 0:
            raise InvalidArgument(f"{what} must not be negative, got {value_s}")
        if value_s == 0:
            return default
        if value_s > limit:
            raise InvalidArgument(f"{what} of {value_s:.3f} s is over the limit of {limit:.0f} s")
        return value_s

    # ---- daemons ----------------------------------------------------------------------------

    def register_daemon(self, spec: DaemonSpec, inventory: dict[int, list[InventoryItem]]) -> int:
        """(Re)registers a daemon and adopts its inventory as COMPLETE replicas.

        Whatever the index held for this daemon before is dropped first: the daemon's word on
        what its segments hold wins. Returns how many inventory items were refused (overlap,
        out of range, a key already stored elsewhere).
        """
        if not spec.daemon_id:
            raise InvalidArgument("daemon_id must not be empty")
        seg_ids = [s.segment_id for s in spec.segments]
        if len(set(seg_ids)) != len(seg_ids):
            raise InvalidArgument(f"daemon {spec.daemon_id}: duplicate segment ids {seg_ids}")
        for s in spec.segments:
            if s.capacity <= 0:
                raise InvalidArgument(f"segment {s.segment_id}: capacity must be positive, got {s.capacity}")
        for seg_id in inventory:
            if seg_id not in seg_ids:
                raise InvalidArgument(f"inventory names unknown segment {seg_id}")
        if spec.daemon_id in self.daemons:
            self._drop_daemon(spec.daemon_id)
        now = self.clock.now()
        daemon = Daemon(spec, now + self.limits.daemon_ttl_s, now)
        rejected = 0
        for sspec in spec.segments:
            items = inventory.get(sspec.segment_id, [])
            alloc, accepted = Allocator.with_used(sspec.capacity, [(it.offset, extent_size(it.length)) for it in items])
            seg = Segment(daemon, sspec, next(self._segment_refs), alloc)
            daemon.segments[sspec.segment_id] = seg
            for it, ok in zip(items, accepted):  # oldest first: LRU order
                if not ok or len(it.key) != KEY_BYTES or it.key in self.entries:
                    if ok:
                        alloc.release(it.offset, extent_size(it.length))
                    rejected += 1
                    continue
                entry = Entry(it.key, 0)
                rep = Replica(seg, it.offset, extent_size(it.length), it.length, entry)
                rep.set_checksum(it.checksum)
                entry.replica = rep
                entry.complete = True
                self.entries[it.key] = entry
                seg.blocks += 1
                seg.lru[it.key] = rep
        self.daemons[spec.daemon_id] = daemon
        return rejected

    def heartbeat(self, daemon_id: str) -> tuple[bool, list[tuple[int, bytes, int]]]:
        """Extends a daemon's liveness. Returns (known, invalidations to apply)."""
        d = self.daemons.get(daemon_id)
        if d is None:
            return False, []
        now = self.clock.now()
        d.last_heartbeat = now
        d.deadline = now + self.limits.daemon_ttl_s
        inv, d.invalidations = d.invalidations, []
        return True, inv

    def _drop_daemon(self, daemon_id: str) -> None:
        d = self.daemons.pop(daemon_id)
        for put in self.puts.values():
            # Entries keep their position in put.entries: commit arrays are aligned with it.
            for e in put.entries:
                if e.replica is not None and e.replica.segment.daemon is d:
                    e.replica.live = False
                    e.replica = None
                    if self.entries.get(e.key) is e:
                        del self.entries[e.key]
        # Every COMPLETE replica on it, leased and pinned ones included (those are not in the LRU).
        for e in [e for e in self.entries.values() if e.replica is not None and e.replica.segment.daemon is d]:
            self._drop_replica(e.replica, free=False)  # type: ignore[arg-type]

    # ---- writes -----------------------------------------------------------------------------

    def put_start(
        self,
        packed_keys: bytes,
        sizes: list[int],
        host_id: str = "",
        timeout_s: float = 0.0,
        exclude: Iterable[str] = (),
    ) -> PutStartResult:
        keys = self._keys(packed_keys)
        if len(sizes) != len(keys):
            raise InvalidArgument(f"sizes: {len(sizes)} sizes for {len(keys)} keys")
        for i, s in enumerate(sizes):
            if s <= 0 or s > self.limits.max_block_bytes:
                raise InvalidArgument(f"sizes[{i}]: block size {s} must be in [1, {self.limits.max_block_bytes}]")
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys: a batch must not repeat a key")
        timeout = self._timeout(timeout_s, self.limits.put_timeout_s, self.limits.max_put_timeout_s, "put timeout")
        excluded = set(exclude)
        segments = self._placement_order(host_id, excluded)
        if not segments:
            raise ResourceExhausted("no live daemon with a DRAM segment to place blocks on")
        biggest = max(s.alloc.capacity for s in segments)
        for i, s in enumerate(sizes):
            if extent_size(s) > biggest:
                raise InvalidArgument(f"sizes[{i}]: block of {s} bytes is larger than any segment ({biggest} bytes)")

        now = self.clock.now()
        put_id = next(self._put_ids)
        status: list[int] = []
        placements: list[Replica] = []
        allocated: list[Entry] = []
        # The request's stored keys must not be evicted to make room for its new ones (a chain's
        # new tail is worthless without its head): hold them out of the LRU meanwhile.
        held = []
        for k in keys:
            e = self.entries.get(k)
            if e is not None and e.complete and e.replica is not None and e.replica.segment.lru.pop(k, None):
                held.append(e.replica)
        try:
            out_of_space = False
            for key, size in zip(keys, sizes):
                e = self.entries.get(key)
                if e is not None:
                    status.append(PutStatus.SKIP_EXISTS if e.complete else PutStatus.SKIP_INFLIGHT)
                    continue
                rep = None if out_of_space else self._allocate(segments, extent_size(size))
                if rep is None:
                    out_of_space = True  # keep chain order: nothing after a gap is placed
                    status.append(PutStatus.NO_SPACE)
                    continue
                seg, offset = rep
                e = Entry(key, put_id)
                e.replica = Replica(seg, offset, extent_size(size), size, e)
                seg.blocks += 1
                self.entries[key] = e
                allocated.append(e)
                status.append(PutStatus.ALLOCATED)
                placements.append(e.replica)
        finally:
            for rep in held:
                if rep.live and rep.leases == 0 and not rep.entry.pinned:
                    rep.segment.lru[rep.entry.key] = rep
        n_skip = sum(1 for s in status if s in (PutStatus.SKIP_EXISTS, PutStatus.SKIP_INFLIGHT))
        n_nospace = status.count(PutStatus.NO_SPACE)
        if not allocated and n_nospace:
            self.counters["no_space_keys"] += n_nospace
            raise ResourceExhausted(
                f"no space for {n_nospace} blocks: every evictable block is leased, pinned or being written"
            )
        self.counters["dedup_keys"] += n_skip
        self.counters["no_space_keys"] += n_nospace
        self.counters["puts"] += 1
        if allocated:
            self.puts[put_id] = Put(put_id, now + timeout, keys, allocated)
        else:
            self._touch_chain(keys)
        return PutStartResult(put_id, status, placements, timeout)

    def _placement_order(self, host_id: str, excluded: set[str]) -> list[Segment]:
        segs = [
            s
            for d in self.daemons.values()
            if d.spec.daemon_id not in excluded
            for s in d.segments.values()
            if s.spec.tier == Tier.DRAM
        ]
        segs.sort(key=lambda s: (s.daemon.spec.host_id != host_id, -s.alloc.free))
        return segs

    def _allocate(self, segments: list[Segment], size: int) -> tuple[Segment, int] | None:
        for seg in segments:
            off = seg.alloc.alloc(size)
            if off is not None:
                return seg, off
        for seg in segments:  # evict, preferred segment first
            while seg.lru:
                self._evict_one(seg)
                off = seg.alloc.alloc(size)
                if off is not None:
                    return seg, off
        return None

    def _evict_one(self, seg: Segment) -> None:
        _, rep = seg.lru.popitem(last=False)
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += rep.length
        self._drop_replica(rep)

    def put_commit(self, put_id: int, checksums: list[int], written: list[bool] | None = None) -> int:
        put = self.puts.get(put_id)
        if put is not None and put.deadline < self.clock.now():
            self.put_abort(put_id)
            self.counters["expired_puts"] += 1
            put = None
        if put is None:
            raise Expired(f"put {put_id} is unknown or past its deadline: its reservation was reclaimed")
        if len(checksums) != len(put.entries):
            raise InvalidArgument(
                f"checksums: {len(checksums)} for {len(put.entries)} allocated blocks of put {put_id}"
            )
        if written is not None and len(written) != len(put.entries):
            raise InvalidArgument(
                f"written: {len(written)} flags for {len(put.entries)} allocated blocks of put {put_id}"
            )
        del self.puts[put_id]
        committed = 0
        for i, (e, csum) in enumerate(zip(put.entries, checksums)):
            rep = e.replica
            if rep is None:  # its daemon was lost meanwhile
                continue
            if written is not None and not written[i]:
                self._free_pending(e)
                continue
            rep.set_checksum(csum)
            e.complete = True
            committed += 1
            self.counters["put_keys"] += 1
            self.counters["put_bytes"] += rep.length
        self._touch_chain(put.keys)
        return committed

    def put_abort(self, put_id: int) -> int:
        put = self.puts.pop(put_id, None)
        if put is None:
            raise NotFound(f"put {put_id} is unknown (already committed, aborted or expired)")
        released = 0
        for e in put.entries:
            if e.replica is not None:
                self._free_pending(e)
                released += 1
        return released

    def _free_pending(self, e: Entry) -> None:
        rep = e.replica
        assert rep is not None and not e.complete
        rep.segment.alloc.release(rep.offset, rep.size)
        rep.segment.blocks -= 1
        rep.live = False
        e.replica = None
        if self.entries.get(e.key) is e:
            del self.entries[e.key]

    # ---- reads ------------------------------------------------------------------------------

    def _run(self, keys: list[bytes]) -> list[Entry]:
        run = []
        get = self.entries.get
        for k in keys:
            e = get(k)
            if e is None or not e.complete:
                break
            run.append(e)
        return run

    def lookup(
        self, packed_keys: bytes, per_key: bool = False, with_locations: bool = False
    ) -> tuple[int, list[bool], list[Replica]]:
        """Leading hit count (and per-key existence, and the run's replicas). No side effects
        on the index (counters aside)."""
        keys = self._keys(packed_keys)
        run = self._run(keys)
        self.counters["lookups"] += 1
        self.counters["lookup_keys"] += len(keys)
        self.counters["lookup_hit_keys"] += len(run)
        exists: list[bool] = []
        if per_key:
            get = self.entries.get
            exists = [(e := get(k)) is not None and e.complete for k in keys]
        return len(run), exists, [e.replica for e in run] if with_locations else []  # type: ignore[misc]

    def acquire(self, packed_keys: bytes, ttl_s: float = 0.0) -> AcquireResult:
        """Leases the leading run of available keys: none of them is evicted or freed until the
        lease is released or expires. A run of 0 takes no lease (lease id 0)."""
        keys = self._keys(packed_keys)
        ttl = self._timeout(ttl_s, self.limits.lease_ttl_s, self.limits.max_lease_ttl_s, "lease ttl")
        run = self._run(keys)
        self.counters["acquires"] += 1
        self.counters["hit_keys"] += len(run)
        self.counters["miss_keys"] += len(keys) - len(run)
        if not run:
            return AcquireResult(0, 0, [], ttl)
        reps = []
        for e in run:
            rep = e.replica
            assert rep is not None
            self._lease(rep)
            self.counters["hit_bytes"] += rep.length
            reps.append(rep)
        lease_id = next(self._lease_ids)
        self.leases[lease_id] = Lease(lease_id, self.clock.now() + ttl, reps)
        return AcquireResult(len(run), lease_id, reps, ttl)

    def _lease(self, rep: Replica) -> None:
        if rep.leases == 0:
            rep.segment.leased += 1
            rep.segment.lru.pop(rep.entry.key, None)
        rep.leases += 1

    def _unlease(self, rep: Replica) -> None:
        rep.leases -= 1
        if rep.leases:
            return
        rep.segment.leased -= 1
        if not rep.live:
            rep.segment.alloc.release(rep.offset, rep.size)
            return
        if not rep.entry.pinned:
            rep.segment.lru[rep.entry.key] = rep

    def release(self, lease_id: int, corrupt: Iterable[int] = ()) -> None:
        """Ends a lease; replicas at the ``corrupt`` run indexes failed their checksum and are dropped."""
        lease = self.leases.get(lease_id)
        if lease is None:
            raise NotFound(f"lease {lease_id} is unknown (already released or expired)")
        bad = sorted(set(corrupt))
        for i in bad:
            if not 0 <= i < len(lease.replicas):
                raise InvalidArgument(f"corrupt index {i} is outside the leased run of {len(lease.replicas)}")
        del self.leases[lease_id]
        for i in bad:
            rep = lease.replicas[i]
            if rep.live:
                self.counters["corrupt_reported"] += 1
                self._drop_replica(rep)
        # Tail first, so that the chain's head ends up most recently used.
        for rep in reversed(lease.replicas):
            self._unlease(rep)

    # ---- management -------------------------------------------------------------------------

    def remove(self, packed_keys: bytes) -> int:
        keys = self._keys(packed_keys)
        n = 0
        for k in keys:
            e = self.entries.get(k)
            if e is not None and e.complete and e.replica is not None:
                self._drop_replica(e.replica)
                n += 1
        self.counters["removed"] += n
        return n

    def pin(self, packed_keys: bytes, pinned: bool = True) -> int:
        keys = self._keys(packed_keys)
        n = 0
        for k in keys:
            e = self.entries.get(k)
            if e is None or not e.complete or e.replica is None or e.pinned == pinned:
                continue
            e.pinned = pinned
            rep = e.replica
            if pinned:
                rep.segment.pinned += 1
                rep.segment.lru.pop(k, None)
            else:
                rep.segment.pinned -= 1
                if rep.leases == 0:
                    rep.segment.lru[k] = rep
            n += 1
        return n

    def _drop_replica(self, rep: Replica, free: bool = True) -> None:
        """Removes a COMPLETE replica from the index. Its extent is freed now, or when its last
        lease ends; ``free=False`` (daemon lost) forgets the space along with the daemon."""
        e = rep.entry
        seg = rep.segment
        if not rep.live:
            return
        rep.live = False
        seg.lru.pop(e.key, None)
        seg.blocks -= 1
        if e.pinned:
            seg.pinned -= 1
            e.pinned = False
        if e.replica is rep:
            e.replica = None
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
        if free:
            seg.daemon.invalidations.append((seg.spec.segment_id, e.key, rep.offset))
            if rep.leases == 0:
                seg.alloc.release(rep.offset, rep.size)

    def _touch_chain(self, keys: list[bytes]) -> None:
        for k in reversed(keys):
            e = self.entries.get(k)
            if e is not None and e.complete and e.replica is not None:
                lru = e.replica.segment.lru
                if k in lru:
                    lru.move_to_end(k)
                elif e.replica.leases == 0 and not e.pinned:
                    lru[k] = e.replica

    # ---- time -------------------------------------------------------------------------------

    def expire(self) -> dict[str, int]:
        """Reclaims what outlived its deadline: daemons, put reservations, leases."""
        now = self.clock.now()
        out = {"daemons": 0, "puts": 0, "leases": 0}
        for did in [d for d, st in self.daemons.items() if st.deadline < now]:
            self._drop_daemon(did)
            out["daemons"] += 1
        for pid in [p for p, put in self.puts.items() if put.deadline < now]:
            self.put_abort(pid)
            out["puts"] += 1
        for lid in [lid for lid, lease in self.leases.items() if lease.deadline < now]:
            self.release(lid)
            out["leases"] += 1
        self.counters["daemons_lost"] += out["daemons"]
        self.counters["expired_puts"] += out["puts"]
        self.counters["expired_leases"] += out["leases"]
        return out

    # ---- introspection ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Asserts the accounting: every live replica is in exactly one place, every segment's
        used bytes equal its replicas' extents (plus freed-but-leased ones), LRU holds only
        evictable replicas."""
        per_seg: dict[int, int] = {}
        blocks: dict[int, int] = {}
        for key, e in self.entries.items():
            assert e.key == key
            rep = e.replica
            assert rep is not None and rep.live, f"entry {key.hex()} has no live replica"
            seg = rep.segment
            assert seg.daemon.spec.daemon_id in self.daemons
            per_seg[id(seg)] = per_seg.get(id(seg), 0) + rep.size
            blocks[id(seg)] = blocks.get(id(seg), 0) + 1
            in_lru = key in seg.lru
            should = e.complete and rep.leases == 0 and not e.pinned
            assert in_lru == should, f"entry {key.hex()}: in LRU {in_lru}, evictable {should}"
        for d in self.daemons.values():
            for seg in d.segments.values():
                seg.alloc.check_integrity()
                # Dropped replicas still leased keep their extent until the lease ends (count once).
                extra = sum(
                    {
                        id(r): r.size
                        for lease in self.leases.values()
                        for r in lease.replicas
                        if not r.live and r.segment is seg
                    }.values()
                )
                assert seg.alloc.used == per_seg.get(id(seg), 0) + extra, (
                    f"segment {d.spec.daemon_id}/{seg.spec.segment_id}: allocator used {seg.alloc.used} "
                    f"!= replicas {per_seg.get(id(seg), 0)} + released-but-leased {extra}"
                )
                assert seg.blocks == blocks.get(id(seg), 0), (
                    f"segment block count {seg.blocks} != {blocks.get(id(seg), 0)}"
                )
