"""The cluster index: which blocks exist, where their replicas are, who holds them.

Pure state and policy: no I/O, no gRPC, time from an injected :class:`Clock`; the service
(:mod:`kvstore.meta.service`) is a thin adapter over it. One event loop owns it, so no locks.

Replica life cycle::

    PutStart -> PENDING (extent reserved, invisible) --PutCommit--> COMPLETE (visible, evictable)
                   |                                                   |
                   +-- PutAbort / deadline / daemon lost --> freed     +-- evict / Remove /
                                                                           corrupt / daemon lost --> freed

Eviction is per segment, least recently used first, over ready replicas that are neither
leased nor pinned (those are not in the LRU at all, so they can never be picked). Every access
touches a chain's keys from tail to head, so a chain's head is always more recent than its tail
and the tail is dropped first: a block is worthless without its predecessors.

Generations and tombstones. Every placement gets a generation (unique, from a nanosecond
clock), which the daemon's sealed header of the block carries. A committed block that leaves the
index with its extent freed (removed, evicted, moved away, reported corrupt) leaves a tombstone
(segment, key, offset, generation) for its daemon; the service delivers tombstones to the daemon
before it acknowledges the call that made them (see :mod:`kvstore.meta.service`), so a restarted
service, rebuilding from inventories, never sees a removed or evicted block again, and a late
tombstone can never clear a newer block that reuses the extent (another generation). Pending
replicas need none: a block becomes part of an inventory only when the daemon commits it.

Tiers. A block has one or two replicas: DRAM, SSD, or both (an SSD copy promoted back to DRAM
keeps its SSD copy, so dropping that DRAM copy later costs nothing). Where a daemon has an SSD
segment, its DRAM is never simply dropped: a DRAM replica without an SSD copy leaves DRAM only
by a *move* (demotion) planned here and carried out by the daemon, and the SSD replica is made
ready before the DRAM one is freed. Puts go to DRAM, or straight to SSD when DRAM has no room
that can be freed at once. SSD is the last tier: its LRU victims are dropped.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Generator, Iterable

from kvstore.errors import Expired, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvstore.extent import extent_size
from kvstore.keys import KEY_BYTES, unpack_keys
from kvstore.meta.allocator import Allocator
from kvstore.meta.records import (  # noqa: F401 - re-exported: the index API names them
    ROW,
    SEGMENT_ALIGN,
    AcquireResult,
    Clock,
    CommitStatus,
    Daemon,
    DaemonSpec,
    Entry,
    IndexLimits,
    InventoryItem,
    Lease,
    Move,
    PendingCommit,
    Put,
    PutStartResult,
    PutStatus,
    Replica,
    Segment,
    SegmentSpec,
    Tier,
    Tombstone,
)

_COUNTERS = (
    "lookups", "lookup_keys", "lookup_hit_keys", "acquires", "hit_keys", "miss_keys", "hit_bytes",
    "ssd_hit_keys", "puts", "put_keys", "put_bytes", "put_ssd_keys", "dedup_keys", "no_space_keys",
    "evictions", "evicted_bytes", "dropped_clean", "demoted", "demoted_bytes", "promoted",
    "promoted_bytes", "moves_failed", "removed", "expired_puts", "expired_leases", "corrupt_reported",
    "daemons_lost", "daemons_drained", "commit_failed_keys", "tombstones", "tombstones_dropped", "stall_grace",
)  # fmt: skip

# Tombstones kept for daemons that could not take them yet (unreachable or gone); past this the
# oldest are dropped (a warning is counted), so a daemon that never returns cannot grow memory.
MAX_TOMBSTONES = 1 << 20


def _expired(heap: list[tuple[float, int]], table: dict, now: float) -> list[int]:
    """Pops the (deadline, id) entries of ``heap`` that passed; returns the ids still in
    ``table`` whose deadline passed (the others ended earlier)."""
    out = []
    while heap and heap[0][0] < now:
        _, i = heapq.heappop(heap)
        item = table.get(i)
        if item is not None and item.deadline < now:
            out.append(i)
    return out


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
        self.moves: dict[int, Move] = {}
        # Blocks read from SSD, to be promoted to DRAM in the background (insertion-ordered set).
        self.promote_queue: dict[bytes, None] = {}
        # Ids start at a random point so that ids from before a restart are never reused.
        base = random.getrandbits(62)
        self._put_ids = itertools.count(base)
        self._lease_ids = itertools.count(base)
        self._move_ids = itertools.count(base)
        self._segment_refs = itertools.count(1)
        self._last_gen = 0
        # Tombstones per daemon id, not yet delivered; kept across the daemon's loss and
        # re-registration (see :meth:`take_tombstones`).
        self.tombstones: dict[str, list[Tombstone]] = {}
        self._n_tombstones = 0
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        # (deadline, id) of puts and leases, so that expiry costs what expires (entries of
        # puts and leases that ended earlier are skipped when they come up).
        self._put_deadlines: list[tuple[float, int]] = []
        self._lease_deadlines: list[tuple[float, int]] = []

    def _next_gen(self) -> int:
        """A fresh generation: unique in this index, above every generation it has seen, and
        (from the wall clock in ns) above those of a service that ran before it."""
        self._last_gen = max(self._last_gen + 1, time.time_ns())
        return self._last_gen

    # ---- tombstones -------------------------------------------------------------------------

    def _tombstone(self, rep: Replica) -> None:
        seg = rep.segment
        self.tombstones.setdefault(seg.daemon.spec.daemon_id, []).append(
            Tombstone(seg.spec.segment_id, rep.entry.key, rep.offset, rep.gen)
        )
        self._n_tombstones += 1
        self.counters["tombstones"] += 1
        if self._n_tombstones > MAX_TOMBSTONES:
            did = max(self.tombstones, key=lambda d: len(self.tombstones[d]))
            drop = len(self.tombstones[did]) // 2 or 1
            del self.tombstones[did][:drop]
            self._n_tombstones -= drop
            self.counters["tombstones_dropped"] += drop

    def take_tombstones(self, daemon_ids: Iterable[str] | None = None) -> dict[str, list[Tombstone]]:
        """Hands over the undelivered tombstones (of the given daemons, default all known
        daemons). The caller delivers them and gives back what it could not
        (:meth:`return_tombstones`)."""
        ids = [d for d in (self.daemons if daemon_ids is None else daemon_ids) if self.tombstones.get(d)]
        out = {d: self.tombstones.pop(d) for d in ids}
        self._n_tombstones -= sum(len(v) for v in out.values())
        return out

    def return_tombstones(self, daemon_id: str, items: list[Tombstone]) -> None:
        """Tombstones that could not be delivered, kept for the daemon's next heartbeat."""
        if items:
            self.tombstones.setdefault(daemon_id, [])[:0] = items
            self._n_tombstones += len(items)

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

    # ---- replica bookkeeping ----------------------------------------------------------------

    def _add_replica(self, e: Entry, seg: Segment, offset: int, size: int, length: int, gen: int = 0) -> Replica:
        rep = Replica(seg, offset, size, length, e, gen or self._next_gen())
        e.replicas.append(rep)
        seg.replicas.add(rep)
        seg.blocks += 1
        if e.pinned:
            seg.pinned += 1
        return rep

    def _make_ready(self, rep: Replica, csum: int) -> None:
        rep.set_checksum(csum)
        rep.ready = True
        if rep.evictable():
            rep.segment.lru[rep.entry.key] = rep

    def _drop_replica(self, rep: Replica, free: bool = True) -> None:
        """Removes a replica from the index. Its extent is freed now, or when its last lease
        ends; ``free=False`` (daemon lost) forgets the space along with the daemon. An entry
        left with no ready replica leaves the index. A freed replica that the daemon may hold
        committed leaves a tombstone for it."""
        if not rep.live:
            return
        e = rep.entry
        seg = rep.segment
        committed = rep.ready or rep.written
        rep.live = False
        rep.ready = False
        seg.lru.pop(e.key, None)
        seg.replicas.discard(rep)
        seg.blocks -= 1
        if e.pinned:
            seg.pinned -= 1
        if rep in e.replicas:
            e.replicas.remove(rep)
        if free:
            if committed:
                self._tombstone(rep)
            if rep.leases == 0:
                seg.alloc.release(rep.offset, rep.size)
        if e.complete and not any(r.ready for r in e.replicas):
            for r in list(e.replicas):  # a pending move target of a vanished block
                self._drop_replica(r, free)
            e.complete = False
            e.pinned = False
            if self.entries.get(e.key) is e:
                del self.entries[e.key]
        elif not e.complete and not e.replicas and self.entries.get(e.key) is e:
            del self.entries[e.key]

    # ---- daemons ----------------------------------------------------------------------------

    def register_daemon(self, spec: DaemonSpec, inventory: dict[int, list[InventoryItem]]) -> int:
        """(Re)registers a daemon and adopts its inventory as ready replicas, in one go.

        Whatever the index held for this daemon before is dropped first: the daemon's word on
        what its segments hold wins. Returns how many inventory items were refused (overlap,
        out of range, a key already stored on another daemon).
        """
        steps = self.register_daemon_steps(spec, inventory, chunk=0)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def register_daemon_steps(
        self, spec: DaemonSpec, inventory: dict[int, list[InventoryItem]], chunk: int = 20_000
    ) -> Generator[None, None, int]:
        """:meth:`register_daemon` in steps of ``chunk`` inventory items (0: one step), so that
        a caller can serve other requests between them (a big inventory takes seconds). The
        daemon is known from the first step, with every extent of its inventory reserved, but
        takes no puts or moves until the last; its lease is renewed at every step. A second
        registration of the same daemon meanwhile supersedes this one (which then stops).
        Bad input raises at the first step, having changed nothing."""
        if not spec.daemon_id:
            raise InvalidArgument("daemon_id must not be empty")
        seg_ids = [s.segment_id for s in spec.segments]
        if len(set(seg_ids)) != len(seg_ids):
            raise InvalidArgument(f"daemon {spec.daemon_id}: duplicate segment ids {seg_ids}")
        for s in spec.segments:
            if s.capacity <= 0:
                raise InvalidArgument(f"segment {s.segment_id}: capacity must be positive, got {s.capacity}")
            if s.tier not in (Tier.DRAM, Tier.SSD):
                raise InvalidArgument(f"segment {s.segment_id}: tier {int(s.tier)} cannot hold blocks (DRAM=1, SSD=2)")
        for seg_id in inventory:
            if seg_id not in seg_ids:
                raise InvalidArgument(f"inventory names unknown segment {seg_id}")
        if spec.daemon_id in self.daemons:
            self._drop_daemon(spec.daemon_id)
        now = self.clock.now()
        daemon = Daemon(spec, now + self.limits.daemon_ttl_s, now, adopting=True)
        self.daemons[spec.daemon_id] = daemon
        rejected = 0
        # Blocks dropped while the daemon could not be told stay dropped (their tombstones
        # are still pending, and go out with its next heartbeat).
        dead = {(t.segment_id, t.key, t.offset, t.gen) for t in self.tombstones.get(spec.daemon_id, ())}
        # Every segment with its inventory's extents reserved first; DRAM first, so that an
        # entry's DRAM replica is its first.
        plan = []
        for sspec in sorted(spec.segments, key=lambda s: int(s.tier)):
            align = SEGMENT_ALIGN[sspec.tier]
            items = inventory.get(sspec.segment_id, [])
            sizes = [it.size or extent_size(it.length, align) for it in items]
            alloc, accepted = Allocator.with_used(
                sspec.capacity, [(it.offset, sz) for it, sz in zip(items, sizes)], align
            )
            seg = Segment(daemon, sspec, next(self._segment_refs), alloc)
            daemon.segments[sspec.segment_id] = seg
            plan.append((sspec, seg, alloc, items, sizes, accepted))
        done = 0
        for sspec, seg, alloc, items, sizes, accepted in plan:
            for it, size, ok in zip(items, sizes, accepted):  # oldest first: LRU order
                done += 1
                if chunk and done % chunk == 0:
                    yield
                    if self.daemons.get(spec.daemon_id) is not daemon:
                        return rejected  # superseded, or dropped meanwhile
                    daemon.deadline = self.clock.now() + self.limits.daemon_ttl_s
                self._last_gen = max(self._last_gen, it.gen)
                e = self.entries.get(it.key)
                clash = e is not None and (
                    not e.complete
                    or e.on(sspec.tier) is not None
                    or any(r.segment.daemon is not daemon for r in e.replicas)
                    or e.replica.length != it.length  # type: ignore[union-attr]
                )
                tomb = (sspec.segment_id, it.key, it.offset, it.gen) in dead
                if not ok or len(it.key) != KEY_BYTES or clash or tomb or not it.gen:
                    if ok:
                        alloc.release(it.offset, size)
                    rejected += 1
                    continue
                if e is None:
                    e = Entry(it.key, 0)
                    self.entries[it.key] = e
                rep = self._add_replica(e, seg, it.offset, size, it.length, it.gen)
                e.complete = True
                self._make_ready(rep, it.checksum)
        daemon.adopting = False
        return rejected

    def heartbeat(self, daemon_id: str) -> bool:
        """Extends a daemon's liveness. False if the daemon is unknown (it must register)."""
        d = self.daemons.get(daemon_id)
        if d is None:
            return False
        now = self.clock.now()
        d.last_heartbeat = now
        d.deadline = now + self.limits.daemon_ttl_s
        return True

    def _drop_daemon(self, daemon_id: str) -> None:
        """Forgets a daemon and its replicas (ready and reserved: puts in flight on it commit
        nothing there; entries keep their position in put.entries). Costs the daemon's own
        blocks, not the index's."""
        d = self.daemons.pop(daemon_id)
        for mid in [m for m, mv in self.moves.items() if mv.src.segment.daemon is d]:
            self.finish_move(mid, False)
        for seg in d.segments.values():
            for r in list(seg.replicas):
                self._drop_replica(r, free=False)

    def drain_daemon(self, daemon_id: str) -> tuple[int, int, float]:
        """A daemon leaving on purpose: it takes no more puts and its blocks leave the index
        now. Returns (blocks dropped, read leases on its blocks still held, seconds until the
        last of them runs out), so that the daemon keeps serving what was handed out. It may
        be called again (dropping nothing) to follow the leases."""
        d = self.daemons.get(daemon_id)
        blocks = 0
        if d is not None:
            blocks = sum(seg.blocks for seg in d.segments.values())
            self._drop_daemon(daemon_id)
            self.counters["daemons_drained"] += 1
        now = self.clock.now()
        held, wait = 0, 0.0
        for lease in self.leases.values():
            if any(r.segment.daemon.spec.daemon_id == daemon_id for r in lease.replicas):
                held += 1
                wait = max(wait, lease.deadline - now)
        return blocks, held, wait

    def grace(self, seconds: float) -> None:
        """The service itself did not run for ``seconds`` (a long call, a paused process):
        heartbeats that arrived in that time could not be handled, so no daemon's lease counts
        that time against it."""
        for d in self.daemons.values():
            d.deadline += seconds
        self.counters["stall_grace"] += 1

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
            # Retryable: right after a service restart daemons have not re-registered yet, or
            # the writer excluded the only daemons it could not reach.
            why = f" (excluded: {', '.join(sorted(excluded))})" if excluded else ""
            raise Unavailable(f"no live daemon with a segment to place blocks on{why}")
        for i, s in enumerate(sizes):
            if not any(extent_size(s, seg.align) <= seg.alloc.capacity for seg in segments):
                biggest = max(seg.alloc.capacity for seg in segments)
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
            if e is not None and e.complete:
                for r in e.replicas:
                    if r.segment.lru.pop(k, None) is not None:
                        held.append(r)
        try:
            out_of_space = False
            for key, size in zip(keys, sizes):
                e = self.entries.get(key)
                if e is not None:
                    status.append(PutStatus.SKIP_EXISTS if e.complete else PutStatus.SKIP_INFLIGHT)
                    continue
                got = None if out_of_space else self._allocate(segments, size)
                if got is None:
                    out_of_space = True  # keep chain order: nothing after a gap is placed
                    status.append(PutStatus.NO_SPACE)
                    continue
                seg, offset = got
                e = Entry(key, put_id)
                rep = self._add_replica(e, seg, offset, extent_size(size, seg.align), size)
                self.entries[key] = e
                allocated.append(e)
                status.append(PutStatus.ALLOCATED)
                placements.append(rep)
        finally:
            for rep in reversed(held):  # tail first: the chain's head ends up most recent
                if rep.evictable():
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
            heapq.heappush(self._put_deadlines, (now + timeout, put_id))
        else:
            self._touch_chain(keys)
        return PutStartResult(put_id, status, placements, timeout)

    def _placement_order(self, host_id: str, excluded: set[str]) -> list[Segment]:
        """DRAM segments (same host first, then most free), then SSD segments likewise."""
        segs = [
            s
            for d in self.daemons.values()
            if d.spec.daemon_id not in excluded and not d.adopting
            for s in d.segments.values()
            if s.spec.tier in (Tier.DRAM, Tier.SSD)
        ]
        segs.sort(key=lambda s: (int(s.spec.tier), s.daemon.spec.host_id != host_id, -s.alloc.free))
        return segs

    def _allocate(self, segments: list[Segment], length: int) -> tuple[Segment, int] | None:
        for seg in segments:
            off = seg.alloc.alloc(extent_size(length, seg.align))
            if off is not None:
                return seg, off
        for seg in segments:  # make room, preferred segment first
            size = extent_size(length, seg.align)
            while True:
                victim = self._victim(seg)
                if victim is None:
                    break
                self._evict(victim)
                off = seg.alloc.alloc(size)
                if off is not None:
                    return seg, off
        return None

    def _victim(self, seg: Segment, scan: int = 512) -> Replica | None:
        """What to drop to make room in ``seg`` without losing a block that has nowhere else
        to go: any LRU replica, except that in a DRAM segment of a daemon with SSD only
        replicas that already have an SSD copy qualify (the others wait for demotion)."""
        if not seg.lru:
            return None
        if seg.spec.tier != Tier.DRAM or seg.daemon.tier(Tier.SSD) is None:
            return next(iter(seg.lru.values()))
        for i, rep in enumerate(seg.lru.values()):
            if i >= scan:
                break
            if len(rep.entry.replicas) > 1:
                return rep
        return None

    def _evict(self, rep: Replica) -> None:
        if len(rep.entry.replicas) > 1:
            self.counters["dropped_clean"] += 1
        else:
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += rep.length
        self._drop_replica(rep)

    def put_commit_begin(self, put_id: int, checksums: list[int], written: list[bool] | None = None) -> PendingCommit:
        """First half of a commit: validates, takes the put out of the reservation table (its
        deadline no longer applies) and releases the blocks the writer did not write. The
        caller has the daemons commit the rest (:class:`PendingCommit` lists them), then calls
        :meth:`put_commit_end`. Nothing becomes visible before that."""
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
        reps: list[Replica | None] = []
        status: list[int] = []
        for i, e in enumerate(put.entries):
            rep = e.replicas[0] if e.replicas else None  # none: its daemon was lost meanwhile
            if rep is not None and written is not None and not written[i]:
                self._drop_replica(rep)
                reps.append(None)
                status.append(CommitStatus.NOT_WRITTEN)
                continue
            if rep is not None:
                rep.written = True  # from here on the daemon may hold it committed
            reps.append(rep)
            status.append(CommitStatus.OK if rep is not None else CommitStatus.UNAVAILABLE)
        return PendingCommit(put, reps, status, list(checksums))

    def put_commit_end(
        self, pc: PendingCommit, outcome: dict[int, tuple[int, int]] | None = None
    ) -> tuple[int, list[int]]:
        """Second half: ``outcome`` maps a block's placement index to (CommitStatus, stored
        extent bytes or 0) as its daemon answered; a block without an outcome counts as
        committed (``None``: all, for callers without daemons). Committed blocks become visible;
        the others are released. Returns (committed count, status per allocated block)."""
        committed = 0
        status = list(pc.status)
        for i, rep in enumerate(pc.replicas):
            if rep is None:
                continue
            st, stored = (outcome or {}).get(i, (CommitStatus.OK, 0))
            if not rep.live:  # its daemon was lost while it committed
                status[i] = CommitStatus.UNAVAILABLE
                continue
            if st != CommitStatus.OK:
                status[i] = st
                self.counters["commit_failed_keys"] += 1
                self._drop_replica(rep)
                continue
            e = rep.entry
            if 0 < stored < rep.size and stored % rep.segment.align == 0:
                rep.segment.alloc.release(rep.offset + stored, rep.size - stored)
                rep.size = stored
            e.complete = True
            self._make_ready(rep, pc.checksums[i])
            committed += 1
            self.counters["put_keys"] += 1
            self.counters["put_bytes"] += rep.length
            if rep.tier == Tier.SSD:
                self.counters["put_ssd_keys"] += 1
        self._touch_chain(pc.put.keys)
        return committed, status

    def put_commit(self, put_id: int, checksums: list[int], written: list[bool] | None = None) -> int:
        """Both halves at once, for callers whose daemons commit on their own (unit tests, the
        policy benchmark). Returns how many blocks became visible."""
        return self.put_commit_end(self.put_commit_begin(put_id, checksums, written))[0]

    def put_abort(self, put_id: int) -> int:
        put = self.puts.pop(put_id, None)
        if put is None:
            raise NotFound(f"put {put_id} is unknown (already committed, aborted or expired)")
        released = 0
        for e in put.entries:
            for r in list(e.replicas):
                self._drop_replica(r)
                released += 1
        return released

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
        """Leases the leading run of available keys: none of their read replicas is evicted or
        freed until the lease is released or expires. A run of 0 takes no lease (lease id 0).
        Blocks served from SSD are queued for promotion to DRAM."""
        keys = self._keys(packed_keys)
        ttl = self._timeout(ttl_s, self.limits.lease_ttl_s, self.limits.max_lease_ttl_s, "lease ttl")
        run = self._run(keys)
        self.counters["acquires"] += 1
        self.counters["hit_keys"] += len(run)
        self.counters["miss_keys"] += len(keys) - len(run)
        if not run:
            return AcquireResult(0, 0, [], ttl)
        reps = []
        nbytes = 0
        for e in run:
            rep = e.replica
            assert rep is not None
            if rep.leases == 0:
                rep.segment.leased += 1
                rep.segment.lru.pop(e.key, None)
            rep.leases += 1
            nbytes += rep.length
            if rep.segment.spec.tier != Tier.DRAM:
                self.counters["ssd_hit_keys"] += 1
                self.promote_queue[e.key] = None
            reps.append(rep)
        self.counters["hit_bytes"] += nbytes
        lease_id = next(self._lease_ids)
        deadline = self.clock.now() + ttl
        self.leases[lease_id] = Lease(lease_id, deadline, reps)
        heapq.heappush(self._lease_deadlines, (deadline, lease_id))
        return AcquireResult(len(run), lease_id, reps, ttl)

    def _unlease(self, rep: Replica) -> None:
        rep.leases -= 1
        if rep.leases:
            return
        rep.segment.leased -= 1
        if not rep.live:
            rep.segment.alloc.release(rep.offset, rep.size)
            return
        if rep.evictable():
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

    # ---- tier moves -------------------------------------------------------------------------

    def plan_moves(self, max_bytes: int = 64 << 20, skip: Iterable[str] = ()) -> dict[str, list[Move]]:
        """Plans demotions (DRAM above its high watermark: coldest replicas without an SSD copy
        go to SSD) and promotions (blocks recently read from SSD come back to DRAM), per daemon,
        except for the daemons in ``skip`` (their previous batch is still under way).

        Each move leases its source and reserves its target; the caller has the daemon copy
        the bytes and then calls :meth:`finish_move`. Nothing becomes visible before that.
        """
        plans: dict[str, list[Move]] = {}
        skip = set(skip)
        later: list[bytes] = []
        for d in self.daemons.values():
            if d.spec.daemon_id in skip or d.adopting:
                continue
            dram, ssd = d.tier(Tier.DRAM), d.tier(Tier.SSD)
            if dram is None or ssd is None:
                continue
            moves = self._plan_demotions(dram, ssd, max_bytes)
            if moves:
                plans.setdefault(d.spec.daemon_id, []).extend(moves)
        budget = max_bytes
        while self.promote_queue and budget > 0:
            key = next(iter(self.promote_queue))
            del self.promote_queue[key]
            e = self.entries.get(key)
            if e is None or not e.complete or e.moving or e.on(Tier.DRAM) is not None:
                continue
            src = e.on(Tier.SSD)
            if src is None or not src.ready:
                continue
            dram = src.segment.daemon.tier(Tier.DRAM)
            if dram is None:
                continue
            if dram.daemon.spec.daemon_id in skip or dram.daemon.adopting:
                later.append(key)
                continue
            # Promote into the room above the high watermark (halfway to full): the next round of
            # demotions then moves the coldest blocks out, and puts keep room in the rest.
            high = self.limits.dram_high_watermark
            if dram.alloc.used + extent_size(src.length, dram.align) > dram.alloc.capacity * (high + (1 - high) / 2):
                continue
            off = dram.alloc.alloc(extent_size(src.length, dram.align))
            if off is None:
                continue
            mv = self._start_move(e, src, dram, off, demote=False)
            plans.setdefault(dram.daemon.spec.daemon_id, []).append(mv)
            budget -= src.length
        for key in later:
            self.promote_queue[key] = None
        return plans

    def _plan_demotions(self, dram: Segment, ssd: Segment, max_bytes: int) -> list[Move]:
        cap = dram.alloc.capacity
        if dram.alloc.used <= cap * self.limits.dram_high_watermark:
            return []
        goal = dram.alloc.used - int(cap * self.limits.dram_low_watermark)
        moves: list[Move] = []
        planned = 0
        limit = min(goal, max_bytes)
        # The coldest replicas worth this round's bytes (a walk of the LRU's head, not a copy
        # of it); acting on them changes the LRU, so they are taken first.
        cands: list[Replica] = []
        acc = 0
        for rep in dram.lru.values():
            if acc >= limit:
                break
            if not rep.entry.moving:
                cands.append(rep)
                acc += rep.size
        for rep in cands:
            if planned >= limit:
                break
            e = rep.entry
            if e.moving or not rep.live or rep.segment.lru.get(e.key) is not rep:
                continue
            if e.on(Tier.SSD) is not None:  # already has an SSD copy: just drop this one
                planned += rep.size
                self.counters["dropped_clean"] += 1
                self._drop_replica(rep)
                continue
            size = extent_size(rep.length, ssd.align)
            off = ssd.alloc.alloc(size)
            while off is None:
                victim = next((r for r in ssd.lru.values() if r.entry is not e), None)
                if victim is None:
                    break
                self._evict(victim)
                off = ssd.alloc.alloc(size)
            if off is None:
                break  # SSD full of leased / pinned / in-flight blocks
            moves.append(self._start_move(e, rep, ssd, off, demote=True))
            planned += rep.size
        return moves

    def _start_move(self, e: Entry, src: Replica, seg: Segment, offset: int, demote: bool) -> Move:
        if src.leases == 0:
            src.segment.leased += 1
            src.segment.lru.pop(e.key, None)
        src.leases += 1
        dst = self._add_replica(e, seg, offset, extent_size(src.length, seg.align), src.length)
        dst.written = True  # the daemon writes it as soon as it gets the move
        e.moving = True
        mv = Move(next(self._move_ids), src, dst, demote)
        self.moves[mv.move_id] = mv
        return mv

    def finish_move(self, move_id: int, ok: bool, stored_size: int = 0) -> None:
        """Completes a move after the daemon copied the bytes (``ok``) or failed to. On success
        the target becomes ready first; a demotion's source is freed only after that. A target
        stored in fewer bytes (compressed) gives back the rest of its extent."""
        mv = self.moves.pop(move_id, None)
        if mv is None:
            return
        e, src, dst = mv.src.entry, mv.src, mv.dst
        e.moving = False
        if ok and src.live and dst.live:
            if 0 < stored_size < dst.size and stored_size % dst.segment.align == 0:
                dst.segment.alloc.release(dst.offset + stored_size, dst.size - stored_size)
                dst.size = stored_size
            self._make_ready(dst, src.checksum)
            kind = "demoted" if mv.demote else "promoted"
            self.counters[kind] += 1
            self.counters[f"{kind}_bytes"] += src.length
            self._unlease(src)
            if mv.demote:
                self._drop_replica(src)
            return
        self.counters["moves_failed"] += 1
        if dst.live:
            self._drop_replica(dst)
        self._unlease(src)

    # ---- management -------------------------------------------------------------------------

    def remove(self, packed_keys: bytes) -> int:
        keys = self._keys(packed_keys)
        n = 0
        for k in keys:
            e = self.entries.get(k)
            if e is not None and e.complete:
                for r in list(e.replicas):
                    self._drop_replica(r)
                n += 1
        self.counters["removed"] += n
        return n

    def pin(self, packed_keys: bytes, pinned: bool = True) -> int:
        keys = self._keys(packed_keys)
        n = 0
        for k in keys:
            e = self.entries.get(k)
            if e is None or not e.complete or e.pinned == pinned:
                continue
            e.pinned = pinned
            for rep in e.replicas:
                if pinned:
                    rep.segment.pinned += 1
                    rep.segment.lru.pop(k, None)
                else:
                    rep.segment.pinned -= 1
                    if rep.evictable():
                        rep.segment.lru[k] = rep
            n += 1
        return n

    def _touch_chain(self, keys: list[bytes]) -> None:
        for k in reversed(keys):
            e = self.entries.get(k)
            if e is None or not e.complete:
                continue
            for rep in e.replicas:
                lru = rep.segment.lru
                if k in lru:
                    lru.move_to_end(k)
                elif rep.evictable():
                    lru[k] = rep

    # ---- time -------------------------------------------------------------------------------

    def expire(self) -> dict[str, int]:
        """Reclaims what outlived its deadline: daemons, put reservations, leases."""
        now = self.clock.now()
        out = {"daemons": 0, "puts": 0, "leases": 0}
        for did in [d for d, st in self.daemons.items() if st.deadline < now]:
            self._drop_daemon(did)
            out["daemons"] += 1
        for pid in _expired(self._put_deadlines, self.puts, now):
            self.put_abort(pid)
            out["puts"] += 1
        for lid in _expired(self._lease_deadlines, self.leases, now):
            self.release(lid)
            out["leases"] += 1
        self.counters["daemons_lost"] += out["daemons"]
        self.counters["expired_puts"] += out["puts"]
        self.counters["expired_leases"] += out["leases"]
        return out

    # ---- introspection ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Asserts the accounting: every live replica is in exactly one place, every segment's
        used bytes equal its replicas' extents (plus freed-but-leased ones), LRU holds exactly
        the evictable replicas, a complete entry has a ready replica."""
        per_seg: dict[int, int] = {}
        blocks: dict[int, int] = {}
        pinned: dict[int, int] = {}
        for key, e in self.entries.items():
            assert e.key == key
            assert e.replicas, f"entry {key.hex()} has no replica"
            if e.complete:
                assert any(r.ready for r in e.replicas), f"complete entry {key.hex()} has no ready replica"
            tiers = [r.segment.spec.tier for r in e.replicas]
            assert len(tiers) == len(set(tiers)), f"entry {key.hex()} has two replicas on one tier"
            for rep in e.replicas:
                assert rep.live and rep.entry is e
                seg = rep.segment
                assert seg.daemon.spec.daemon_id in self.daemons
                per_seg[id(seg)] = per_seg.get(id(seg), 0) + rep.size
                blocks[id(seg)] = blocks.get(id(seg), 0) + 1
                if e.pinned:
                    pinned[id(seg)] = pinned.get(id(seg), 0) + 1
                in_lru = seg.lru.get(key) is rep
                assert in_lru == rep.evictable(), f"entry {key.hex()}: in LRU {in_lru}, evictable {rep.evictable()}"
        for d in self.daemons.values():
            for seg in d.segments.values():
                seg.alloc.check_integrity()
                for key, rep in seg.lru.items():
                    assert rep.live and rep.segment is seg and rep.entry.key == key
                # Dropped replicas still held keep their extent until released (count once): by a
                # read lease, or as the source of a tier move in flight.
                held = [r for lease in self.leases.values() for r in lease.replicas]
                held += [mv.src for mv in self.moves.values()]
                extra = sum({id(r): r.size for r in held if not r.live and r.segment is seg}.values())
                assert seg.alloc.used == per_seg.get(id(seg), 0) + extra, (
                    f"segment {d.spec.daemon_id}/{seg.spec.segment_id}: allocator used {seg.alloc.used} "
                    f"!= replicas {per_seg.get(id(seg), 0)} + released-but-leased {extra}"
                )
                assert seg.blocks == blocks.get(id(seg), 0), (
                    f"segment block count {seg.blocks} != {blocks.get(id(seg), 0)}"
                )
                assert seg.pinned == pinned.get(id(seg), 0), f"segment pinned {seg.pinned} != {pinned.get(id(seg), 0)}"
                assert len(seg.replicas) == seg.blocks, f"segment replica set {len(seg.replicas)} != {seg.blocks}"
                assert all(r.live and r.segment is seg and r in r.entry.replicas for r in seg.replicas)
