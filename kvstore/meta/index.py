"""The cluster index: which blocks exist, where their replicas are, who holds them.

Pure state and policy: no I/O, no gRPC, time from an injected :class:`Clock`; the service
(:mod:`kvstore.meta.service`) is a thin adapter over it. One event loop owns it, so no locks.

Replica life cycle::

    PutStart -> PENDING (extent reserved, invisible) --PutCommit--> COMPLETE (visible, evictable)
                   |                                                   |
                   +-- PutAbort / deadline / not written --> held      +-- evict / Remove /
                   |   back until the put's write tickets lapse,           corrupt / daemon lost --> freed
                   |   then freed (:mod:`.quarantine`)
                   +-- daemon lost --> forgotten with the daemon

The module is split where its seams are: the records it is made of (:mod:`.records`), extent
allocation (:mod:`.allocator`), daemon membership and tombstones (:mod:`.membership`), writes,
placement and eviction (:mod:`.writes`), the cache policy (:mod:`.policy`), tier planning
(:mod:`.tiers`) and the engines' device tier (:mod:`.engines`); this file holds the state, the
reads, management, expiry and the integrity check.

Eviction is per segment, over ready replicas that are neither leased nor pinned (those are not in
the segment's recency order at all, so they can never be picked), in the order the cache policy
chooses. Every access touches a chain's keys from tail to head, so a chain's head is always more
recent than its tail and the tail is dropped first: a block is worthless without its
predecessors.

Generations and tombstones. Every placement gets a generation (unique, from a nanosecond
clock), which the daemon's sealed header of the block carries. A registration's inventory may
name generations below :data:`~kvstore.meta.records.GEN_LIMIT` (2**63) only, so that the
counter, which runs above every generation it has seen, always fits the wire's 64 bits
(:data:`~kvstore.meta.records.GEN_MAX`); it raises rather than go past them. A committed block
that leaves the index with its extent freed (removed, evicted, moved away, reported corrupt)
leaves a tombstone (segment, key, offset, generation) for its daemon; the service delivers
tombstones to the daemon before it acknowledges the call that made them (see
:mod:`kvstore.meta.service`), so a restarted service, rebuilding from inventories, never sees a
removed or evicted block again, and a late tombstone can never clear a newer block that reuses
the extent (another generation). Pending replicas need none: a block becomes part of an
inventory only when the daemon commits it.

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
import random
import time
from collections.abc import Iterable

from kvstore.errors import Internal, InvalidArgument
from kvstore.meta.checks import Checks
from kvstore.meta.engines import DeviceTier, EngineTier
from kvstore.meta.membership import MAX_TOMBSTONES, Membership  # noqa: F401 - re-exported
from kvstore.meta.policy import make_policy
from kvstore.meta.quarantine import Quarantine
from kvstore.meta.records import (  # noqa: F401 - re-exported: the index API names them
    COUNTERS,
    GEN_LIMIT,
    GEN_MAX,
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
    expired,
)
from kvstore.meta.tiers import TierMoves
from kvstore.meta.writes import Writes


class Index(Checks, Membership, Writes, TierMoves, DeviceTier):
    """The metadata service's state. Every public method validates its input first and changes
    nothing when it raises."""

    def __init__(self, limits: IndexLimits | None = None, clock: Clock | None = None) -> None:
        self.limits = limits or IndexLimits()
        self.clock = clock or Clock()
        self.entries: dict[bytes, Entry] = {}
        self.policy = make_policy(self.limits.cache_policy, self.entries)
        # Blocks held in engines' own caches (the device tier): known, not readable here.
        self.engine_tier = EngineTier.for_limits(self.limits)
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
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        # (deadline, id) of puts and leases, so that expiry costs what expires (entries of
        # puts and leases that ended earlier are skipped when they come up).
        self._put_deadlines: list[tuple[float, int]] = []
        self._lease_deadlines: list[tuple[float, int]] = []
        # Extents of puts that ended uncommitted, until their write tickets lapse.
        self._quarantine = Quarantine()

    def _gens_left(self, n: int) -> None:
        """Raises (having changed nothing) unless ``n`` more generations fit in 64 bits. Cannot
        happen while registrations stay below GEN_LIMIT: 2**63 placements are left above them."""
        if max(self._last_gen + 1, time.time_ns()) + n - 1 > GEN_MAX:
            raise Internal(f"generation counter exhausted: {n} more would pass 2**64 - 1 (last {self._last_gen})")

    def _next_gen(self) -> int:
        """A fresh generation: unique in this index, above every generation it has seen, and
        (from the wall clock in ns) above those of a service that ran before it; never past
        GEN_MAX (raises :class:`~kvstore.errors.Internal`, having changed nothing)."""
        self._gens_left(1)
        self._last_gen = max(self._last_gen + 1, time.time_ns())
        return self._last_gen

    def _current(self, seg: Segment) -> bool:
        """Whether ``seg`` is a segment of a daemon the index knows now (not of a lost one)."""
        return self.daemons.get(seg.daemon.spec.daemon_id) is seg.daemon

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

    def _drop_replica(self, rep: Replica, free: bool = True, hold_until: float | None = None) -> None:
        """Removes a replica from the index. Its extent is freed now, or when its last lease
        ends, or (``hold_until``: a put's reservation whose write tickets are still good) at that
        time on the index clock; ``free=False`` (daemon lost) forgets the space along with the
        daemon. An entry left with no ready replica leaves the index. A freed replica that the
        daemon may hold committed leaves a tombstone for it at once (also under a lease: a reader
        that then finds it gone asks the index again, kvstore.client.reads; a tombstone held back
        until the lease ends would be lost with a restart, and the block would come back)."""
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
                if hold_until is None:
                    seg.alloc.release(rep.offset, rep.size)
                else:
                    self._quarantine.hold(seg, rep.offset, rep.size, hold_until)
        if e.complete and not any(r.ready for r in e.replicas):
            for r in list(e.replicas):  # a pending move target of a vanished block
                self._drop_replica(r, free)
            e.complete = False
            e.pinned = False
            if self.entries.get(e.key) is e:
                self.policy.removed(e)  # before the entries change (kvstore.meta.policy: defer)
                del self.entries[e.key]
        elif not e.complete and not e.replicas and self.entries.get(e.key) is e:
            self.policy.removed(e)
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
        """Leases the leading run of available keys: none of their read replicas is evicted or
        freed until the lease is released or expires. A run of 0 takes no lease (lease id 0).
        Blocks served from SSD are queued for promotion to DRAM."""
        keys = self._keys(packed_keys)
        ttl = self._timeout(ttl_s, self.limits.lease_ttl_s, self.limits.max_lease_ttl_s, "lease ttl")
        run = self._run(keys)
        self.policy.access(keys, len(run))
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

    def touch(self, chains: list[bytes]) -> int:
        """Reads that a client served itself from locations it held (no lease): each packed chain
        counts for the cache policy as an :meth:`acquire` of it would (access counts, recency tail
        first, SSD blocks queued for promotion). Returns how many of the keys are stored."""
        total = 0
        parsed = []
        for i, packed in enumerate(chains):
            keys = self._keys(packed, f"chains[{i}]")
            total += len(keys)
            if total > self.limits.max_batch_keys:
                raise InvalidArgument(f"chains: over the limit of {self.limits.max_batch_keys} keys in one call")
            parsed.append(keys)
        stored = 0
        for keys in parsed:
            run = self._run(keys)
            self.policy.access(keys, len(run))
            for e in run:
                rep = e.replica
                if rep is not None and rep.segment.spec.tier != Tier.DRAM:
                    self.promote_queue[e.key] = None
            self._touch_chain(keys)
            stored += len(run)
            self.counters["touches"] += 1
            self.counters["touched_keys"] += len(run)
        return stored

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
        lease, bad = self._release_args(lease_id, corrupt, "replicas")
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

    def pin_candidates(self, packed_keys: bytes) -> dict[bytes, int]:
        """The committed, unpinned blocks among ``packed_keys`` and their payload bytes: what
        pinning them would add (tenant quotas)."""
        out: dict[bytes, int] = {}
        for k in self._keys(packed_keys):
            e = self.entries.get(k)
            if e is not None and e.complete and not e.pinned and e.replica is not None:
                out[k] = e.replica.length
        return out

    def is_pinned(self, key: bytes) -> bool:
        e = self.entries.get(key)
        return e is not None and e.pinned

    def locations(self, replicas: list[Replica]) -> list[Replica]:
        """The locations an answer names, spelled out: the object index's are its replicas
        (the compact index answers with rows of its table and spells them out here)."""
        return replicas

    def __len__(self) -> int:
        """Blocks in the index (committed or being written)."""
        return len(self.entries)

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
        """Reclaims what outlived its deadline: daemons, put reservations, leases; frees the
        extents of ended puts whose write tickets lapsed."""
        now = self.clock.now()
        out = {"daemons": 0, "puts": 0, "leases": 0}
        for did in [d for d, st in self.daemons.items() if st.deadline < now]:
            self._drop_daemon(did)
            out["daemons"] += 1
        out["engines"] = self.engine_tier.expire(now)
        for pid in expired(self._put_deadlines, self.puts, now):
            self.put_abort(pid)
            out["puts"] += 1
        for lid in expired(self._lease_deadlines, self.leases, now):
            self.release(lid)
            out["leases"] += 1
        self._quarantine.release(now, self._current)
        self.counters["daemons_lost"] += out["daemons"]
        self.counters["expired_puts"] += out["puts"]
        self.counters["expired_leases"] += out["leases"]
        return out

    # ---- introspection ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Asserts the accounting: every live replica is in exactly one place, every segment's
        used bytes equal its replicas' extents (plus freed-but-leased ones and those held back
        in quarantine), these extents and the free ranges never overlap, LRU holds exactly the
        evictable replicas, a complete entry has a ready replica."""
        self.engine_tier.check_integrity()
        self.policy.check_integrity()
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
        # Dropped replicas still held keep their extent until released (count once): by a read
        # lease, or as the source of a tier move in flight.
        held = [r for lease in self.leases.values() for r in lease.replicas]
        held += [mv.src for mv in self.moves.values()]
        held_extents = {id(r): r for r in held if not r.live}
        quarantined: dict[int, list[tuple[int, int]]] = {}
        for seg, offset, size in self._quarantine.extents(self._current):
            quarantined.setdefault(id(seg), []).append((offset, size))
        for d in self.daemons.values():
            for seg in d.segments.values():
                seg.alloc.check_integrity()
                for key, rep in seg.lru.items():
                    assert rep.live and rep.segment is seg and rep.entry.key == key
                extra = sum(r.size for r in held_extents.values() if r.segment is seg)
                q = quarantined.get(id(seg), [])
                assert seg.quarantined == sum(size for _, size in q), (
                    f"segment {d.spec.daemon_id}/{seg.spec.segment_id}: quarantined {seg.quarantined} "
                    f"!= its held extents {sum(size for _, size in q)}"
                )
                assert seg.alloc.used == per_seg.get(id(seg), 0) + extra + seg.quarantined, (
                    f"segment {d.spec.daemon_id}/{seg.spec.segment_id}: allocator used {seg.alloc.used} "
                    f"!= replicas {per_seg.get(id(seg), 0)} + released-but-leased {extra} "
                    f"+ quarantined {seg.quarantined}"
                )
                used = [(r.offset, r.size) for r in seg.replicas]
                used += [(r.offset, r.size) for r in held_extents.values() if r.segment is seg]
                seg.alloc.check_disjoint(used + q)
                assert seg.blocks == blocks.get(id(seg), 0), (
                    f"segment block count {seg.blocks} != {blocks.get(id(seg), 0)}"
                )
                assert seg.pinned == pinned.get(id(seg), 0), f"segment pinned {seg.pinned} != {pinned.get(id(seg), 0)}"
                assert len(seg.replicas) == seg.blocks, f"segment replica set {len(seg.replicas)} != {seg.blocks}"
                assert all(r.live and r.segment is seg and r in r.entry.replicas for r in seg.replicas)
