"""Writes to the index: placing a put's blocks (same host first, DRAM before SSD), making room
by eviction as the cache policy picks and admits, and the two-phase commit. Part of
:class:`kvstore.meta.index.Index` (a mixin over its state: ``entries``, ``daemons``, ``puts``,
``policy``, ``counters``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from kvstore.errors import Expired, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvstore.extent import extent_size
from kvstore.meta.records import (
    CommitStatus,
    Daemon,
    Entry,
    PendingCommit,
    Put,
    PutStartResult,
    PutStatus,
    Replica,
    Segment,
    Tier,
)

_DECLINED = object()  # _allocate: the cache policy did not admit the block


def placement_order(daemons: Iterable[Daemon], host_id: str, excluded: set[str]) -> list[Segment]:
    """Where a put's blocks go, in order: DRAM segments (same host first, then most free), then
    SSD segments likewise; not on daemons still adopting their inventory or ``excluded``."""
    segs = [
        s
        for d in daemons
        if d.spec.daemon_id not in excluded and not d.adopting
        for s in d.segments.values()
        if s.spec.tier in (Tier.DRAM, Tier.SSD)
    ]
    segs.sort(key=lambda s: (int(s.spec.tier), s.daemon.spec.host_id != host_id, -s.alloc.free))
    return segs


class Writes:
    """PutStart, PutCommit, PutAbort and the placement and eviction behind them."""

    # ---- writes -----------------------------------------------------------------------------

    def put_start(
        self,
        packed_keys: bytes,
        sizes: list[int],
        host_id: str = "",
        timeout_s: float = 0.0,
        exclude: Iterable[str] = (),
    ) -> PutStartResult:
        """Reserves extents for a put's new blocks. Raises having changed nothing, but for blocks
        evicted to make room (gone for good, tombstones owed): should anything fail after space
        was reserved, every reservation of the put is given back before the error goes out."""
        keys = self._keys(packed_keys)
        timeout = self._put_args(keys, sizes, timeout_s)
        self._gens_left(len(keys))
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
            gap = 0  # keep chain order: nothing after a gap is placed (NO_SPACE or NOT_ADMITTED)
            for key, size in zip(keys, sizes):
                e = self.entries.get(key)
                if e is not None:
                    status.append(PutStatus.SKIP_EXISTS if e.complete else PutStatus.SKIP_INFLIGHT)
                    continue
                got = None if gap else self._allocate(segments, size, key)
                if got is None or got is _DECLINED:
                    gap = gap or (PutStatus.NOT_ADMITTED if got is _DECLINED else PutStatus.NO_SPACE)
                    status.append(gap)
                    continue
                seg, offset = got
                e = Entry(key, put_id)
                try:
                    rep = self._add_replica(e, seg, offset, extent_size(size, seg.align), size)
                except BaseException:
                    seg.alloc.release(offset, extent_size(size, seg.align))
                    raise
                allocated.append(e)
                self.policy.created(e)  # before the entries change (kvstore.meta.policy: defer)
                self.entries[key] = e
                status.append(PutStatus.ALLOCATED)
                placements.append(rep)
        except BaseException:
            for e in allocated:  # nothing written there yet: freed at once, no tombstone
                for r in list(e.replicas):
                    self._drop_replica(r)
            raise
        finally:
            for rep in reversed(held):  # tail first: the chain's head ends up most recent
                if rep.evictable():
                    rep.segment.lru[rep.entry.key] = rep
        n_skip = sum(1 for s in status if s in (PutStatus.SKIP_EXISTS, PutStatus.SKIP_INFLIGHT))
        n_nospace = status.count(PutStatus.NO_SPACE)
        self.counters["not_admitted_keys"] += status.count(PutStatus.NOT_ADMITTED)
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
        return placement_order(self.daemons.values(), host_id, excluded)

    def _allocate(self, segments: list[Segment], length: int, key: bytes = b"") -> tuple[Segment, int] | object | None:
        """Room for a block of ``length`` bytes: free space in the first segment that has it,
        else space made by eviction, preferred segment first. None: nothing can be evicted;
        ``_DECLINED``: the policy judged ``key`` colder than what it would evict."""
        for seg in segments:
            off = seg.alloc.alloc(extent_size(length, seg.align))
            if off is not None:
                return seg, off
        judged = False
        for seg in segments:  # make room, preferred segment first
            size = extent_size(length, seg.align)
            while True:
                victim = self._victim(seg)
                if victim is None:
                    break
                if not judged:
                    judged = True
                    if not self.policy.admits(key, victim):
                        return _DECLINED
                self._evict(victim)
                off = seg.alloc.alloc(size)
                if off is not None:
                    return seg, off
        return None

    def _victim(self, seg: Segment, scan: int = 512) -> Replica | None:
        """What to drop to make room in ``seg`` without losing a block that has nowhere else
        to go, as the cache policy picks among the evictable replicas, least recent first:
        any, except that in a DRAM segment of a daemon with SSD only replicas that already
        have an SSD copy qualify (the others wait for demotion; ``scan`` bounds the search)."""
        if not seg.lru:
            return None
        if seg.spec.tier != Tier.DRAM or seg.daemon.tier(Tier.SSD) is None:
            return self.policy.pick(iter(seg.lru.values()))
        eligible = (rep for _, rep in zip(range(scan), seg.lru.values()) if len(rep.entry.replicas) > 1)
        return self.policy.pick(eligible)

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
        :meth:`put_commit_end`. Nothing becomes visible before that. The extents of blocks not
        written are held back until the put's write tickets lapse (:mod:`.quarantine`)."""
        put = self.puts.get(put_id)
        if put is not None and put.deadline < self.clock.now():
            self.put_abort(put_id)
            self.counters["expired_puts"] += 1
            put = None
        if put is None:
            raise Expired(f"put {put_id} is unknown or past its deadline: its reservation was reclaimed")
        self._commit_args(put_id, len(put.entries), checksums, written)
        del self.puts[put_id]
        reps: list[Replica | None] = []
        status: list[int] = []
        for i, e in enumerate(put.entries):
            rep = e.replicas[0] if e.replicas else None  # none: its daemon was lost meanwhile
            if rep is not None and written is not None and not written[i]:
                self._drop_replica(rep, hold_until=put.deadline + self.limits.write_ticket_grace_s)
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
        the others are released, their extents held back until the put's write tickets lapse
        (:mod:`.quarantine`). Returns (committed count, status per allocated block)."""
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
                self._drop_replica(rep, hold_until=pc.put.deadline + self.limits.write_ticket_grace_s)
                continue
            e = rep.entry
            rep.size = rep.segment.trim(rep.offset, rep.size, stored)
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
        """Ends a put without committing it (also at its deadline); returns how many blocks it
        released. Their extents are held back until the put's write tickets lapse: the writer
        may still write there until then (:mod:`.quarantine`)."""
        put = self.puts.pop(put_id, None)
        if put is None:
            raise NotFound(f"put {put_id} is unknown (already committed, aborted or expired)")
        released = 0
        until = put.deadline + self.limits.write_ticket_grace_s
        for e in put.entries:
            for r in list(e.replicas):
                self._drop_replica(r, hold_until=until)
                released += 1
        return released
