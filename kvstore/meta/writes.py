"""Writes to the index (:class:`kvstore.meta.index.Index`): a put's blocks
placed in chain order (same host first, DRAM before SSD, :func:`placement_order`),
room made by evicting each segment's least recently used blocks, and the commit that makes them
visible. A mixin over the index's state (``table``, ``segments``, ``daemons``, ``puts``,
``counters``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvstore.errors import Expired, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvstore.extent import extent_size
from kvstore.keys import KEY_BYTES
from kvstore.meta.records import (
    CommitStatus,
    Daemon,
    PendingCommit,
    PutStartResult,
    PutStatus,
    Segment,
    Tier,
)
from kvstore.meta.table import HELD, LIVE, READY, WRITTEN, words

_NONE = np.empty(0, dtype=np.int64)
DECLINED = object()  # _allocate: the cache policy did not admit the block


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


@dataclass(slots=True)
class Put:
    put_id: int
    deadline: float
    keys: bytes  # the whole request, packed, for touching the chain on commit
    rows: np.ndarray  # the allocated blocks, in placement order
    gens: np.ndarray  # their generations: a row reused since (its daemon was lost) is not theirs


class Writes:
    """PutStart, PutCommit and PutAbort over the block table."""

    def put_start(
        self,
        packed_keys: bytes,
        sizes: list[int],
        host_id: str = "",
        timeout_s: float = 0.0,
        exclude: Iterable[str] = (),
    ) -> PutStartResult:
        """Reserves extents for a put's new blocks; placements are rows. Raises having changed
        nothing, but for blocks evicted to make room (gone for good, tombstones owed): should
        anything fail after space was reserved, every reservation of the put is given back
        before the error goes out."""
        q, rows, ready = self._find(packed_keys)
        keys = [packed_keys[i : i + KEY_BYTES] for i in range(0, len(packed_keys), KEY_BYTES)]
        timeout = self._put_args(keys, sizes, timeout_s)
        self._gens_left(len(keys))
        excluded = set(exclude)
        segments = placement_order(self.daemons.values(), host_id, excluded)
        if not segments:
            why = f" (excluded: {', '.join(sorted(excluded))})" if excluded else ""
            raise Unavailable(f"no live daemon with a segment to place blocks on{why}")
        if not any(extent_size(max(sizes), seg.align) <= seg.alloc.capacity for seg in segments):
            for i, s in enumerate(sizes):  # (the largest does not fit: say which first does not)
                if not any(extent_size(s, seg.align) <= seg.alloc.capacity for seg in segments):
                    biggest = max(seg.alloc.capacity for seg in segments)
                    raise InvalidArgument(
                        f"sizes[{i}]: block of {s} bytes is larger than any segment ({biggest} bytes)"
                    )
        t = self.table
        if t.room() < len(keys):
            raise ResourceExhausted(f"the block table is full ({t.live} blocks): split the index into more shards")
        put_id = next(self._put_ids)
        fast = self._put_in_free_space(put_id, packed_keys, q, rows, ready, sizes, segments[0], timeout)
        if fast is not None:
            return fast
        # The request's stored keys are not evicted to make room for its new ones.
        held = rows[rows >= 0]
        held = held[t.evictable(held)]
        t.flags[held] |= HELD
        status: list[int] = []
        placed: list[tuple[int, Segment, int, int]] = []  # (key index, segment, offset, length)
        freqs: list[int] = []  # the placed blocks' counts, as the cache policy has them
        pol = self.policy
        try:
            gap = 0  # keep chain order: nothing after a gap is placed (NO_SPACE or NOT_ADMITTED)
            for i, size in enumerate(sizes):
                if rows[i] >= 0:
                    status.append(PutStatus.SKIP_EXISTS if ready[i] else PutStatus.SKIP_INFLIGHT)
                    continue
                got = None if gap else self._allocate(segments, size, keys[i])
                if got is None or got is DECLINED:
                    gap = gap or (PutStatus.NOT_ADMITTED if got is DECLINED else PutStatus.NO_SPACE)
                    status.append(gap)
                    continue
                placed.append((i, got[0], got[1], size))
                freqs.append(pol.entering(keys[i]))
                status.append(PutStatus.ALLOCATED)
        except BaseException:
            self._give_back(placed, freqs, keys)
            raise
        finally:
            t.flags[held] &= 0xFF ^ HELD
            held = held[::-1]
            t.stamp(held[t.evictable(held)])
        n_skip = sum(1 for s in status if s in (PutStatus.SKIP_EXISTS, PutStatus.SKIP_INFLIGHT))
        n_nospace = status.count(PutStatus.NO_SPACE)
        self.counters["not_admitted_keys"] += status.count(PutStatus.NOT_ADMITTED)
        if not placed and n_nospace:
            self.counters["no_space_keys"] += n_nospace
            raise ResourceExhausted(
                f"no space for {n_nospace} blocks: every evictable block is leased, pinned or being written"
            )
        self.counters["dedup_keys"] += n_skip
        self.counters["no_space_keys"] += n_nospace
        self.counters["puts"] += 1
        if not placed:
            self._touch_rows(rows)
            return PutStartResult(put_id, status, _NONE, timeout)
        try:
            gens = self._gens(len(placed))
            idx = np.array([p[0] for p in placed], dtype=np.int64)
            new = t.add(q[idx])
        except BaseException:
            self._give_back(placed, freqs, keys)
            raise
        pol.entered(new, freqs)
        t.seg[new] = [p[1].ref for p in placed]
        t.off[new] = [p[2] for p in placed]
        t.size[new] = [extent_size(p[3], p[1].align) for p in placed]
        t.length[new] = [p[3] for p in placed]
        t.gen[new] = gens
        for p in placed:
            p[1].blocks += 1
        deadline = self.clock.now() + timeout
        self.puts[put_id] = Put(put_id, deadline, packed_keys, new, t.gen[new].copy())
        heapq.heappush(self._put_deadlines, (deadline, put_id))
        return PutStartResult(put_id, status, new.copy(), timeout)

    def _put_in_free_space(
        self,
        put_id: int,
        packed_keys: bytes,
        q: np.ndarray,
        rows: np.ndarray,
        ready: np.ndarray,
        sizes: list[int],
        seg: Segment,
        timeout: float,
    ) -> PutStartResult | None:
        """A put whose new blocks, of one size, all fit the free space of the first segment in
        placement order (where each would go, one by one, with no eviction and so nothing for
        the cache policy to judge), placed in one vectorised pass; None if it is not such a put
        (then it goes block by block)."""
        new = np.flatnonzero(rows < 0)
        if len(new) < 64:
            return None  # (small puts: the general path costs as little)
        length = sizes[int(new[0])]
        if any(sizes[i] != length for i in new.tolist()):
            return None
        size = extent_size(length, seg.align)
        offs = seg.alloc.alloc_run(size, len(new))
        if offs is None:
            return None
        t = self.table
        try:
            gens = self._gens(len(new))
            freqs = self.policy.entering_many(q[new])
            r = t.add(q[new])
        except BaseException:
            for off in offs.tolist():
                seg.alloc.release(off, size)
            raise
        self.policy.entered(r, freqs)
        t.seg[r], t.off[r], t.size[r], t.length[r], t.gen[r] = seg.ref, offs, size, length, gens
        seg.blocks += len(r)
        status = np.where(rows >= 0, np.where(ready, PutStatus.SKIP_EXISTS, PutStatus.SKIP_INFLIGHT), 0)
        self.counters["dedup_keys"] += len(rows) - len(new)
        self.counters["puts"] += 1
        if len(new) < len(rows):  # the stored ones are touched, as on the general path
            held = rows[rows >= 0][::-1]
            t.stamp(held[t.evictable(held)])
        deadline = self.clock.now() + timeout
        self.puts[put_id] = Put(put_id, deadline, packed_keys, r, gens.copy())
        heapq.heappush(self._put_deadlines, (deadline, put_id))
        return PutStartResult(put_id, status.tolist(), r.copy(), timeout)

    def _give_back(self, placed: list[tuple[int, Segment, int, int]], freqs: list[int], keys: list[bytes]) -> None:
        """A put that fails before its blocks are in the table: their extents are freed and the
        cache policy gets back the counts it handed over (nothing was written there yet)."""
        for _, seg, off, length in placed:
            seg.alloc.release(off, extent_size(length, seg.align))
        self.policy.gave_up([keys[i] for i, _, _, _ in placed[: len(freqs)]], freqs)

    def _allocate(self, segments: list[Segment], length: int, key: bytes) -> tuple[Segment, int] | object | None:
        """Room for a block: free space in the first segment that has it, else space made by
        eviction (the cache policy's victims), preferred segment first. None: nothing can be
        evicted; ``DECLINED``: the policy judged ``key`` colder than what it would evict.

        In the DRAM of a daemon that has an SSD, only blocks that also have a clean SSD copy
        make room, and they do before a put spills to that SSD's free space (their DRAM copy is
        dropped, the block stays on SSD: nothing is lost, so the policy is not asked to admit);
        the others leave DRAM by demotion, never by eviction."""
        for seg in segments:
            size = extent_size(length, seg.align)
            off = seg.alloc.alloc(size)
            if off is None and size <= seg.alloc.capacity and self._tiered_dram(seg):
                off = self._room_in(seg, size, clean=True)
            if off is not None:
                return seg, off
        judge = [key]  # the policy judges the block once, against the first victim
        for seg in segments:
            size = extent_size(length, seg.align)
            if size > seg.alloc.capacity or self._tiered_dram(seg):
                continue  # (clean drops were tried above)
            off = self._room_in(seg, size, judge)
            if off is DECLINED:
                return DECLINED
            if off is not None:
                return seg, off
        return None

    @staticmethod
    def _tiered_dram(seg: Segment) -> bool:
        return seg.spec.tier == Tier.DRAM and seg.daemon.tier(Tier.SSD) is not None

    def _room_in(
        self, seg: Segment, size: int, judge: list[bytes] | None = None, clean: bool = False
    ) -> int | object | None:
        """An extent of ``size`` bytes in ``seg``, the cache policy's victims there evicted until
        one is free; None if no eviction there makes room (the rest is leased, pinned or being
        written). ``judge``: the key of a block being put, while the policy has yet to admit it
        (emptied once it has; ``DECLINED`` if it does not). ``clean``: only replicas whose block
        has another copy may go (:data:`~kvstore.meta.compact_policy.CLEAN_SCAN` least recent
        looked at)."""
        off = seg.alloc.alloc(size)
        while off is None:
            victim = self.policy.victim(seg.ref, clean=clean)
            if victim < 0:
                return None
            if judge:
                if not self.policy.admits(judge.pop(), victim):
                    return DECLINED
            self._evict(victim, seg)
            off = seg.alloc.alloc(size)
        return off

    def _put_rows(self, put: Put) -> np.ndarray:
        """Which of the put's rows are still its pending blocks (a lost daemon's were dropped)."""
        t = self.table
        # Still in the table, not committed, and of this generation: a row freed with a lost
        # daemon may hold another block since, even this block as that daemon reported it back.
        mine = ((t.flags[put.rows] & (LIVE | READY)) == LIVE) & (t.gen[put.rows] == put.gens)
        return mine & ~self._lost_rows(put.rows)  # a lost daemon's, not yet dropped with it

    def put_commit_begin(self, put_id: int, checksums: list[int], written: list[bool] | None = None) -> PendingCommit:
        """First half of a commit: validates, takes the put out of the reservation table (its
        deadline no longer applies) and releases the blocks the writer did not write (their
        extents held back until the put's write tickets lapse, :mod:`.quarantine`). The caller
        has the daemons commit the rest, then calls :meth:`put_commit_end`; nothing becomes
        visible before that. The pending commit's ``places`` are the blocks the daemons are to
        commit, in columns."""
        put = self.puts.get(put_id)
        if put is not None and put.deadline < self.clock.now():
            self.put_abort(put_id)
            self.counters["expired_puts"] += 1
            put = None
        if put is None:
            raise Expired(f"put {put_id} is unknown or past its deadline: its reservation was reclaimed")
        self._commit_args(put_id, len(put.rows), checksums, written)
        del self.puts[put_id]
        t = self.table
        mine = self._put_rows(put)
        wrote = np.ones(len(put.rows), dtype=bool) if written is None else np.array(written, dtype=bool)
        for row in put.rows[mine & ~wrote].tolist():
            self._drop(row, hold_until=put.deadline + self.limits.write_ticket_grace_s)
        ok = mine & wrote
        t.flags[put.rows[ok]] |= WRITTEN  # from here on the daemon may hold it committed
        status = np.where(ok, CommitStatus.OK, np.where(mine, CommitStatus.NOT_WRITTEN, CommitStatus.UNAVAILABLE))
        # Spelled out now, not when the daemons are asked: a row whose daemon is lost meanwhile
        # is freed and may then hold another put's block.
        places = self.places(put.rows[ok])
        places.index = np.flatnonzero(ok)
        return PendingCommit(put, places, status.tolist(), list(checksums))

    def put_commit_end(
        self, pc: PendingCommit, outcome: dict[int, tuple[int, int]] | None = None
    ) -> tuple[int, list[int]]:
        """Second half: ``outcome`` maps a block's placement
        index to (CommitStatus, stored extent bytes or 0) as its daemon answered; a block
        without one counts as committed. Returns (committed count, status per allocated block)."""
        put: Put = pc.put
        t = self.table
        status = np.array(pc.status, dtype=np.int64)
        asked = np.zeros(len(pc.status), dtype=bool)
        asked[pc.places.index] = True
        # Still the put's: a block of a daemon lost meanwhile was dropped (its row maybe reused).
        good = asked & self._put_rows(put)
        status[asked & ~good] = CommitStatus.UNAVAILABLE
        until = put.deadline + self.limits.write_ticket_grace_s
        for i, (st, stored) in (outcome or {}).items():
            if not 0 <= i < len(good) or not good[i]:  # not one of this put's blocks
                continue
            row = int(put.rows[i])
            if st != CommitStatus.OK:
                status[i] = st
                good[i] = False
                self.counters["commit_failed_keys"] += 1
                self._drop(row, hold_until=until)
                continue
            t.size[row] = self.segments[int(t.seg[row])].trim(int(t.off[row]), int(t.size[row]), stored)
        rows = put.rows[good]
        t.csum[rows] = np.array(pc.checksums, dtype=np.uint64)[good]
        t.set_ready(rows)
        t.stamp(rows[t.evictable(rows)])
        self.counters["put_keys"] += len(rows)
        self.counters["put_bytes"] += int(t.length[rows].sum(dtype=np.uint64))
        for ref in np.unique(t.seg[rows]).tolist():
            if self.segments[ref].spec.tier == Tier.SSD:
                self.counters["put_ssd_keys"] += int((t.seg[rows] == ref).sum())
        self._touch_rows(t.find(words(put.keys)))
        return len(rows), status.tolist()

    def put_commit(self, put_id: int, checksums: list[int], written: list[bool] | None = None) -> int:
        """Both halves at once, for callers whose daemons commit on their own (unit tests,
        benchmarks). Returns how many blocks became visible."""
        return self.put_commit_end(self.put_commit_begin(put_id, checksums, written))[0]

    def put_abort(self, put_id: int) -> int:
        """Ends a put without committing it (also at its deadline); returns how many blocks it
        released. Their extents are held back until the put's write tickets lapse: the writer
        may still write there until then (:mod:`.quarantine`)."""
        put = self.puts.pop(put_id, None)
        if put is None:
            raise NotFound(f"put {put_id} is unknown (already committed, aborted or expired)")
        rows = put.rows[self._put_rows(put)].tolist()
        for row in rows:
            self._drop(row, hold_until=put.deadline + self.limits.write_ticket_grace_s)
        return len(rows)
