"""Daemon membership in the index: registration with inventory adoption, heartbeats, loss and
drain, and the tombstones owed to each daemon. Part of :class:`kvstore.meta.index.Index` (a mixin
over its state: ``table``, ``segments``, ``daemons``, ``tombstones``, ``moves``, ``leases``,
``counters``).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvstore.cluster.slots import arena
from kvstore.meta.allocator import Allocator
from kvstore.meta.inventory import Adoption, columns, dead_rows, extent_sizes
from kvstore.meta.records import (
    SEGMENT_ALIGN,
    Daemon,
    DaemonSpec,
    InventoryItem,
    Segment,
    SegmentSpec,
    Tombstone,
)
from kvstore.meta.table import LIVE, PINNED

if TYPE_CHECKING:
    from kvstore.meta.reads import Lease

# Inventory items adopted per step of a registration (a few tens of milliseconds of the loop).
ADOPT_CHUNK = 16_384
# A lost daemon's drop goes in steps of at most DROP_ROWS of its blocks (each a few random
# accesses to the hash table and the columns: tens of milliseconds of the loop), found by scans
# of DROP_SCAN table rows (a few milliseconds each).
DROP_ROWS = 1 << 14
DROP_SCAN = 1 << 18


class SegmentPlan(NamedTuple):
    """One segment of a registration, planned (:meth:`DaemonLife.plan_registration`)."""

    spec: SegmentSpec
    items: np.ndarray  # the inventory's columns (kvstore.meta.inventory.INVENTORY), oldest first
    sizes: np.ndarray  # each item's extent bytes
    alloc: Allocator  # the segment's allocator, the accepted extents reserved
    accepted: np.ndarray  # per item, whether its extent was


# Tombstones kept for daemons that could not take them yet (unreachable or gone); past this the
# oldest are dropped (a warning is counted), so a daemon that never returns cannot grow memory.
MAX_TOMBSTONES = 1 << 20


class Tombstones:
    """What daemons must forget, kept per daemon until delivered (a mixin over ``tombstones``,
    ``_n_tombstones``, ``daemons`` and ``counters``)."""

    def _tombstone_item(self, daemon_id: str, t: Tombstone) -> None:
        self.tombstones.setdefault(daemon_id, []).append(t)
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


class DaemonLife(Tombstones):
    """A daemon's life in the index: registration driven in one go, heartbeats, drain, stalls
    of the service itself (a mixin over ``daemons``, ``leases``, ``engine_tier``, ``clock``,
    ``limits`` and ``counters``, and :class:`Membership`'s ``_adopt``, ``_drop_daemon`` and
    ``_leased_on``)."""

    def register_daemon(self, spec: DaemonSpec, inventory: dict[int, list[InventoryItem]]) -> int:
        """(Re)registers a daemon and adopts its inventory as ready replicas, in one go.

        Whatever the index held for this daemon before is dropped first: the daemon's word on
        what its segments hold wins. Returns how many inventory items were refused (overlap,
        out of range, a key already stored on another daemon, generation 0, a length or checksum
        past 64 bits). An item whose generation is past the range the index hands out
        (``GEN_LIMIT``, :mod:`kvstore.meta.records`) refuses the whole registration.
        """
        steps = self.register_daemon_steps(spec, inventory, chunk=0)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def plan_registration(
        self, spec: DaemonSpec, inventory: dict[int, list[InventoryItem] | np.ndarray]
    ) -> list[SegmentPlan]:
        """What a registration reserves, per segment (DRAM first, so that a block's DRAM replica
        is its primary): the inventory's columns, each item's extent size, the segment's
        allocator with the inventory's extents reserved, and which extents it accepted. Reads no
        index state (the limits only), so a caller may make it on a thread; raises on bad input
        (:class:`~kvstore.errors.InvalidArgument`), having changed nothing."""
        cols = {sid: columns(items, sid) for sid, items in inventory.items()}
        self._daemon_args(spec, cols)
        plans = []
        for sspec in sorted(spec.segments, key=lambda s: int(s.tier)):
            align = SEGMENT_ALIGN[sspec.tier]
            a = cols.get(sspec.segment_id, columns([]))
            sizes = extent_sizes(a, align)
            base, span = arena(sspec.capacity, align, self.limits.shard, self.limits.shards)
            # Offsets and sizes past 2**63 wrap negative here: out of range, refused.
            # (A malformed item reserves nothing: its size is 0 here.)
            ext = np.stack((a["offset"].view(np.int64), np.where(a["ok"] != 0, sizes, 0).view(np.int64)), axis=1)
            alloc, accepted = Allocator.with_used(span, ext, align, base)
            plans.append(SegmentPlan(sspec, a, sizes, alloc, accepted))
        return plans

    def register_daemon_steps(
        self,
        spec: DaemonSpec,
        inventory: dict[int, list[InventoryItem] | np.ndarray],
        chunk: int = ADOPT_CHUNK,
        plan: list[SegmentPlan] | None = None,
    ) -> Generator[None, None, int]:
        """:meth:`register_daemon` in steps of ``chunk`` inventory items (0: one step), so that
        a caller can serve other requests between them (a big inventory takes seconds). The
        daemon is known from the first step, with every extent of its inventory reserved, but
        takes no puts or moves until the last; its lease is renewed at every step. A second
        registration of the same daemon meanwhile supersedes this one (which then stops).
        Bad input raises at the first step, having changed nothing. Items are adopted in
        vectorised chunks (:mod:`kvstore.meta.inventory`), each segment's in its order (oldest
        first: recency order); ``inventory`` maps a segment id to its items or to their columns
        (:data:`~kvstore.meta.inventory.INVENTORY`). ``plan``: :meth:`plan_registration`'s, made
        beforehand (on a thread) for this ``spec`` and ``inventory``."""
        plans = plan if plan is not None else self.plan_registration(spec, inventory)
        if spec.daemon_id in self.daemons:
            self._start_drop(spec.daemon_id)
            while self.drop_step():
                if chunk:
                    yield
            if spec.daemon_id in self.daemons:
                return 0  # registered again meanwhile: that registration stands
        now = self.clock.now()
        daemon = Daemon(spec, now + self.limits.daemon_ttl_s, now, adopting=True)
        self.daemons[spec.daemon_id] = daemon
        rejected = 0
        # Blocks dropped while the daemon could not be told stay dropped (their tombstones
        # are still pending, and go out with its next heartbeat).
        owed = self.tombstones.get(spec.daemon_id, ())
        segs = []
        for p in plans:
            seg = self._new_segment(daemon, p.spec, p.alloc)
            daemon.segments[p.spec.segment_id] = seg
            segs.append((seg, dead_rows(owed, p.spec.segment_id)))
        self.table.reserve(sum(int(p.accepted.sum()) for p in plans))
        for p, (seg, dead) in zip(plans, segs):
            a, step = p.items, chunk or max(1, len(p.items))
            for lo in range(0, len(a), step):
                if chunk:  # a step ends before each chunk (the first after the table grew for them all)
                    yield
                    if self.daemons.get(spec.daemon_id) is not daemon:
                        return rejected  # superseded, or dropped meanwhile
                    daemon.deadline = self.clock.now() + self.limits.daemon_ttl_s
                hi = lo + step
                rejected += self._adopt_chunk(daemon, seg, a[lo:hi], p.sizes[lo:hi], p.accepted[lo:hi], dead)
        daemon.adopting = False
        return rejected

    def _new_segment(self, daemon: Daemon, sspec: SegmentSpec, alloc: Allocator) -> Segment:
        return Segment(daemon, sspec, next(self._segment_refs), alloc)

    def heartbeat(self, daemon_id: str, registration: int = 0) -> bool:
        """Extends a daemon's liveness. False if the daemon is unknown (it must register), or
        known under another registration than the one it heartbeats for (a registration made
        in its name replaced its own: it must register again, inventory and all); a
        ``registration`` of 0 is not checked."""
        d = self.daemons.get(daemon_id)
        if d is None:
            return False
        if registration and d.spec.registration and registration != d.spec.registration:
            return False
        now = self.clock.now()
        d.last_heartbeat = now
        d.deadline = now + self.limits.daemon_ttl_s
        return True

    def drain_daemon(self, daemon_id: str, stepwise: bool = False) -> tuple[int, int, float]:
        """A daemon leaving on purpose: it takes no more puts and its blocks leave the index
        now (``stepwise``: the caller completes the drop with :meth:`drop_step`). Returns
        (blocks dropped, read leases on its blocks still held, seconds until the last of them
        runs out), so that the daemon keeps serving what was handed out. It may be called again
        (dropping nothing) to follow the leases."""
        d = self.daemons.get(daemon_id)
        blocks = 0
        if d is not None:
            blocks = sum(seg.blocks for seg in d.segments.values())
            self._start_drop(daemon_id)
            if not stepwise:
                self._finish_drops()
            self.counters["daemons_drained"] += 1
        now = self.clock.now()
        held, wait = 0, 0.0
        for lease in self.leases.values():
            if self._leased_on(lease, daemon_id):
                held += 1
                wait = max(wait, lease.deadline - now)
        return blocks, held, wait

    def grace(self, seconds: float) -> None:
        """The service itself did not run for ``seconds`` (a long call, a paused process):
        heartbeats that arrived in that time could not be handled, so no daemon's lease counts
        that time against it."""
        for d in self.daemons.values():
            d.deadline += seconds
        for e in self.engine_tier.engines.values():
            e.deadline += seconds
        self.counters["stall_grace"] += 1


class Membership(Adoption, DaemonLife):
    """Daemons joining and being lost, over the block table."""

    def _new_segment(self, daemon: Daemon, sspec: SegmentSpec, alloc: Allocator) -> Segment:
        seg = super()._new_segment(daemon, sspec, alloc)
        self.segments[seg.ref] = seg
        return seg

    def _drop_daemon(self, daemon_id: str) -> None:
        """Forgets a daemon and its blocks (committed and reserved) and the extents held back
        there, in one go (:meth:`_start_drop` and every :meth:`drop_step`)."""
        self._start_drop(daemon_id)
        self._finish_drops()

    def _finish_drops(self) -> None:
        """Every step of the drops under way, now."""
        while self.drop_step():
            pass

    def _start_drop(self, daemon_id: str) -> None:
        """A daemon leaves the index now: no puts, moves or heartbeats, and none of its blocks
        is found by key from here on. Its blocks leave the table in steps of at most
        :data:`DROP_ROWS` of them (:meth:`drop_step`), so that a daemon of tens of millions of blocks does not
        hold the event loop; a block of it that a call names meanwhile leaves at once
        (:meth:`_settle`). A segment whose blocks are still leased stays known until the last
        lease ends. Nothing is tombstoned or freed: the space goes with the daemon."""
        self._fail_moves(daemon_id)
        d = self.daemons.pop(daemon_id)
        t = self.table
        segs = list(d.segments.values())
        c = t.copies
        crow = c.row[: c.used]
        for seg in segs:
            self._leaving[seg.ref] = seg
            on = (crow >= 0) & (c.seg[: c.used] == seg.ref)
            copies = int(((t.flags[crow[on]] & LIVE) != 0).sum()) if on.any() else 0
            self._zombies += seg.blocks - copies  # rows whose primary is there (copies: same daemon)
        t.reserve_free(self._zombies)
        self._drops.append(self._drop_chunks(segs, t.n_rows))

    def _drop_chunks(self, segs: list[Segment], end: int) -> Generator[None, None, None]:
        t = self.table
        for seg in segs:
            for lo in range(0, end, DROP_SCAN):
                hi = min(end, lo + DROP_SCAN)
                mine = lo + np.flatnonzero(((t.flags[lo:hi] & LIVE) != 0) & (t.seg[lo:hi] == seg.ref))
                for k in range(0, len(mine), DROP_ROWS):
                    part = mine[k : k + DROP_ROWS]
                    # Those a call named since the scan left already (and their rows may hold
                    # other blocks by now).
                    part = part[((t.flags[part] & LIVE) != 0) & (t.seg[part] == seg.ref)]
                    self._drop_lost(part, seg)
                    yield
                if not len(mine):
                    yield
            del self._leaving[seg.ref]
            seg.quarantined = 0  # its entries in the quarantine are skipped when they come up
            t.forget_segment(seg.ref)
            if not seg.leased:
                self.segments.pop(seg.ref, None)

    def drop_step(self) -> bool:
        """One step of the drops of lost daemons under way (rows are scanned in table order, and
        rows added meanwhile are never theirs); returns whether any step is left."""
        if self._drops:
            try:
                next(self._drops[0])
            except StopIteration:
                self._drops.popleft()
        return bool(self._drops)

    def _lost_row(self, row: int) -> bool:
        """Whether ``row`` is a lost daemon's block not yet dropped with it."""
        return bool(self._leaving) and int(self.table.seg[row]) in self._leaving

    def _lost_rows(self, rows: np.ndarray) -> np.ndarray:
        """Per row of ``rows`` (table rows), :meth:`_lost_row`."""
        if not self._leaving:
            return np.zeros(len(rows), dtype=bool)
        return np.isin(self.table.seg[rows], list(self._leaving))

    def _settle(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` as the table's hash lookup found them (-1: none), with those of a lost daemon
        not yet dropped (:meth:`_start_drop`) dropped now and shown as -1."""
        if not self._leaving:
            return rows
        t = self.table
        hit = rows >= 0
        gone = np.zeros(len(rows), dtype=bool)
        gone[hit] = self._lost_rows(rows[hit])
        if not gone.any():
            return rows
        dead = np.unique(rows[gone])
        on = t.seg[dead]
        for ref in np.unique(on).tolist():
            self._drop_lost(dead[on == ref], self._leaving[ref])
        rows = rows.copy()
        rows[gone] = -1
        return rows

    def _drop_lost(self, rows: np.ndarray, seg: Segment) -> None:
        """``rows`` (live, their primary replica on ``seg``) leave with their lost daemon: out of
        the table at once, their copies (on the same daemon) forgotten, nothing tombstoned or
        freed (the space goes with the daemon), each row returned now or when its last lease ends."""
        if not len(rows):
            return
        t = self.table
        self.policy.leaving_many(rows, staying=t.live - self._zombies)
        self._zombies -= len(rows)
        pinned = (t.flags[rows] & PINNED) != 0
        t.unlink_many(rows)
        t.flags[rows] &= 0xFF ^ PINNED
        seg.blocks -= len(rows)
        seg.pinned -= int(pinned.sum())
        c = t.copies
        for r, p in zip(rows[t.copy[rows] != 0].tolist(), pinned[t.copy[rows] != 0].tolist()):
            for i in c.of(r):
                cs = self.segments.get(int(c.seg[i]))
                if cs is not None:
                    cs.blocks -= 1
                    cs.pinned -= int(p)
                c.remove(i)
        t.free_many(rows[t.leases[rows] == 0])

    def _leased_on(self, lease: Lease, daemon_id: str) -> bool:
        return any(
            self.segments[ref].daemon.spec.daemon_id == daemon_id
            for ref in np.unique(self.table.seg[lease.rows]).tolist()
            if ref in self.segments
        )
