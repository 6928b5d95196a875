"""The cluster index: which blocks exist, where their replicas are, who holds them.

Pure state and policy: no I/O, no gRPC, time from an injected :class:`Clock`; the service
(:mod:`kvstore.meta.service`) is a thin adapter over it. One event loop owns it, so no locks.
Every public method validates its input first and changes nothing when it raises.

Block life cycle::

    PutStart -> PENDING (extent reserved, invisible) --PutCommit--> COMPLETE (visible, evictable)
                   |                                                   |
                   +-- PutAbort / deadline / not written --> held      +-- evict / Remove /
                   |   back until the put's write tickets lapse,           corrupt / daemon lost --> freed
                   |   then freed (:mod:`.quarantine`)
                   +-- daemon lost --> forgotten with the daemon

Columns, not objects. Every block is a row of fixed-width columns found through an
open-addressing hash table keyed by its 128-bit key (:mod:`.table`): its primary replica
(segment, extent, generation), payload length and checksum, recency stamp, lease count, flags
and the cache policy's count; further replicas of the same block are rows of a small store
beside it (:mod:`.copies`). About 100 bytes per block whatever the number of blocks, and batch
operations (lookup, acquire, touch, commit) are vectorised over the batch: a lookup costs a
handful of gathers, not a walk of Python objects. Locations come back as rows of the table;
:meth:`Index.location_rows` packs them as the wire's location rows in one call,
:meth:`Index.locations` spells them out (as the service does for its answers).

The module is split where its seams are: the records it is made of (:mod:`.records`), the table
(:mod:`.table`, its recency order :mod:`.recency`, further replicas :mod:`.copies`), extent
allocation (:mod:`.allocator`), replica bookkeeping (:mod:`.replicas`), daemon membership and
tombstones (:mod:`.membership`), inventories adopted in vectorised chunks (:mod:`.inventory`),
reads and leases (:mod:`.reads`), writes, placement and eviction (:mod:`.writes`), the cache
policy (:mod:`.policy`), tier moves (:mod:`.tiers`) and the engines' device tier
(:mod:`.engines`); this file holds the state, management, expiry and the integrity check. :class:`IndexApi` (:mod:`.api`) is the interface the service, the daemon link, the
benchmarks and the tests hold it by.

Eviction is per segment, over committed blocks that are neither leased nor pinned, in the order
the cache policy chooses. Every access touches a chain's keys from tail to head, so a chain's
head is always more recent than its tail and the tail is dropped first: a block is worthless
without its predecessors.

Generations and tombstones. Every placement gets a generation (unique, from a nanosecond
clock), which the daemon's sealed header of the block carries. A registration's inventory may
name generations below :data:`~kvstore.meta.records.GEN_LIMIT` (2**63) only, so that the
counter, which runs above every generation it has seen, always fits the wire's 64 bits
(:data:`~kvstore.meta.records.GEN_MAX`); it raises rather than go past them. A committed replica
that leaves the index with its extent freed (removed, evicted, moved away, reported corrupt)
leaves a tombstone (segment, key, offset, generation) for its daemon; the service delivers
tombstones to the daemon before it acknowledges the call that made them (see
:mod:`kvstore.meta.service`), so a restarted service, rebuilding from inventories, never sees a
removed or evicted block again, and a late tombstone can never clear a newer block that reuses
the extent (another generation). Pending blocks need none: a block becomes part of an inventory
only when the daemon commits it.

Tiers. A block has one or two replicas: DRAM, SSD, or both (an SSD copy promoted back to DRAM
keeps its SSD copy, so dropping that DRAM copy later costs nothing). Where a daemon has an SSD
segment, its DRAM is never simply dropped: a DRAM replica without an SSD copy leaves DRAM only by
a *move* (demotion, :mod:`.tiers`) planned here and carried out by the daemon, and the SSD
replica is made ready before the DRAM one is freed; a put short of DRAM there drops DRAM copies
that have a clean SSD copy, else goes to SSD. SSD is the last tier: its victims are dropped (or,
for a clean copy, just that copy).
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Iterable

import numpy as np

from kvstore.errors import Internal, InvalidArgument
from kvstore.meta.checks import Checks
from kvstore.meta.engines import DeviceTier, EngineTier
from kvstore.meta.membership import Membership
from kvstore.meta.policy import POLICIES
from kvstore.meta.quarantine import Quarantine
from kvstore.meta.reads import Lease, Reads
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
    IndexLimits,
    InventoryItem,
    PendingCommit,
    PolicyParams,
    PutStartResult,
    PutStatus,
    Segment,
    SegmentSpec,
    Tier,
    Tombstone,
    expired,
)
from kvstore.meta.replicas import Location, Replicas
from kvstore.meta.table import LIVE, PINNED, READY, WRITTEN, BlockTable, words
from kvstore.meta.tiers import Move, TierMoves
from kvstore.meta.writes import Put, Writes
from kvstore.wire import pack_rows

_NONE = np.empty(0, dtype=np.int64)


class Index(Checks, Replicas, Membership, Reads, Writes, TierMoves, DeviceTier):
    """The metadata service's state, in columns. See the module docstring."""

    def __init__(self, limits: IndexLimits | None = None, clock: Clock | None = None, rows: int = 1024) -> None:
        self.limits = limits or IndexLimits()
        if self.limits.cache_policy not in POLICIES:
            raise InvalidArgument(f"unknown cache policy {self.limits.cache_policy!r} (one of {', '.join(POLICIES)})")
        self.clock = clock or Clock()
        self.table = BlockTable(rows, counts=self.limits.cache_policy == "adaptive")
        self.policy = POLICIES[self.limits.cache_policy](self.table, self.limits.policy)
        self.engine_tier = EngineTier.for_limits(self.limits)
        self.moves: dict[int, Move] = {}  # tier moves in flight (kvstore.meta.tiers)
        # Rows read from SSD, to be promoted to DRAM in the background: row -> its generation
        # then (a row dropped and reused since holds another generation).
        self.promote_queue: dict[int, int] = {}
        self.daemons: dict[str, Daemon] = {}
        self.segments: dict[int, Segment] = {}  # by ref; a lost daemon's stay while leases hold rows there
        self.puts: dict[int, Put] = {}
        self.leases: dict[int, Lease] = {}
        base = random.getrandbits(62)
        self._put_ids = itertools.count(base)
        self._lease_ids = itertools.count(base)
        self._move_ids = itertools.count(base)
        self._segment_refs = itertools.count(1)
        self._last_gen = 0
        self.tombstones: dict[str, list[Tombstone]] = {}
        self._n_tombstones = 0
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._touch_interval = (0.0, 0.0)  # (longest touch interval reported lately, when)
        # Lost daemons' drops under way (kvstore.meta.membership): their segments by ref, the
        # rows still in the table there, and the drops' remaining steps.
        self._leaving: dict[int, Segment] = {}
        self._zombies = 0
        self._drops: deque = deque()
        self._put_deadlines: list[tuple[float, int]] = []
        self._lease_deadlines: list[tuple[float, int]] = []
        # Extents of puts that ended uncommitted, until their write tickets lapse.
        self._quarantine = Quarantine()

    def _gens_left(self, n: int) -> int:
        """The first of ``n`` fresh generations; raises (having changed nothing) unless they fit
        in 64 bits. Cannot happen while registrations stay below GEN_LIMIT: 2**63 placements
        are left above them."""
        first = max(self._last_gen + 1, time.time_ns())
        if first + n - 1 > GEN_MAX:
            raise Internal(f"generation counter exhausted: {n} more would pass 2**64 - 1 (last {self._last_gen})")
        return first

    def _gens(self, n: int) -> np.ndarray:
        first = self._gens_left(n)
        self._last_gen = first + n - 1
        return np.arange(first, first + n, dtype=np.uint64)

    def _current(self, seg: Segment) -> bool:
        """Whether ``seg`` is a segment of a daemon the index knows now (not of a lost one)."""
        return self.daemons.get(seg.daemon.spec.daemon_id) is seg.daemon

    def _find(self, packed: bytes, what: str = "keys") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The keys' words, their rows (-1: not stored) and whether each is committed."""
        self._count_keys(packed, what)
        q = words(packed)
        rows, ready = self.table.find_ready(q)
        if self._leaving:
            settled = self._settle(rows)
            if settled is not rows:
                rows, ready = settled, ready & (settled >= 0)
        return q, rows, ready

    @staticmethod
    def _run(ready: np.ndarray) -> int:
        """The leading run of committed blocks."""
        return len(ready) if ready.all() else int(np.argmin(ready))

    # ---- locations --------------------------------------------------------------------------

    def locations(self, rows: Iterable[int]) -> list[Location]:
        t = self.table
        return [
            Location(
                self.segments[int(t.seg[r])],
                int(t.off[r]),
                int(t.size[r]),
                int(t.length[r]),
                int(t.csum[r]),
                int(t.gen[r]),
                t.key(r),
            )  # fmt: skip
            for r in rows
        ]

    def location_rows(self, rows: np.ndarray) -> bytes:
        """``rows`` as the wire's packed location rows (:data:`kvstore.meta.records.ROW`)."""
        return pack_rows(self.places(rows))

    # ---- dropping ---------------------------------------------------------------------------

    def _drop(self, row: int, hold_until: float | None = None) -> None:
        """A block leaves the index; its extents are freed now or when its last lease ends, or
        (``hold_until``: a put's reservation whose write tickets are still good) at that time.
        Each replica its daemon may hold committed leaves a tombstone. (Blocks of a lost daemon
        leave through :meth:`kvstore.meta.membership.Membership._drop_lost`.)"""
        t = self.table
        f = int(t.flags[row])
        if not f & LIVE:
            return
        if self._lost_row(row):  # a lost daemon's, not yet dropped with it: it goes as it would have
            self._drop_lost(np.array([row]), self._leaving[int(t.seg[row])])
            return
        seg = self.segments[int(t.seg[row])]
        self.policy.leaving(row)  # before the table changes (kvstore.meta.policy: defer)
        t.unlink(row)
        t.flags[row] &= 0xFF ^ PINNED
        seg.blocks -= 1
        if f & PINNED:
            seg.pinned -= 1
        if f & (READY | WRITTEN):
            self._tombstone_item(
                seg.daemon.spec.daemon_id, Tombstone(seg.spec.segment_id, t.key(row), int(t.off[row]), int(t.gen[row]))
            )
        for i in t.copies.of(row):
            cs = self.segments[int(t.copies.seg[i])]
            cs.blocks -= 1
            if f & PINNED:
                cs.pinned -= 1
            self._tombstone_item(
                cs.daemon.spec.daemon_id,
                Tombstone(cs.spec.segment_id, t.key(row), int(t.copies.off[i]), int(t.copies.gen[i])),
            )
        if t.leases[row] == 0:
            if hold_until is None:
                seg.alloc.release(int(t.off[row]), int(t.size[row]))
            else:
                self._quarantine.hold(seg, int(t.off[row]), int(t.size[row]), hold_until)
            self._free_row(row)

    # ---- management -------------------------------------------------------------------------

    def remove(self, packed_keys: bytes) -> int:
        rows = self._find(packed_keys)[1].tolist()
        n = 0
        for row in rows:
            if row >= 0 and self.table.flags[row] & READY:
                self._drop(row)
                n += 1
        self.counters["removed"] += n
        return n

    def pin(self, packed_keys: bytes, pinned: bool = True) -> int:
        t = self.table
        n = 0
        for row in self._find(packed_keys)[1].tolist():
            if row < 0 or not t.flags[row] & READY or bool(t.flags[row] & PINNED) == pinned:
                continue
            step = 1 if pinned else -1
            for ref in [int(t.seg[row])] + [int(t.copies.seg[i]) for i in t.copies.of(row)]:
                self.segments[ref].pinned += step
            if pinned:
                t.flags[row] |= PINNED
            else:
                t.flags[row] &= 0xFF ^ PINNED
                if t.is_evictable(row):
                    t.stamp_one(row)
            n += 1
        return n

    def pin_candidates(self, packed_keys: bytes) -> dict[bytes, int]:
        """The committed, unpinned blocks among ``packed_keys`` and their payload bytes: what
        pinning them would add (tenant quotas)."""
        t = self.table
        rows = self._find(packed_keys)[1]
        out: dict[bytes, int] = {}
        for row in rows[rows >= 0].tolist():
            if t.flags[row] & READY and not t.flags[row] & PINNED:
                out[t.key(row)] = int(t.length[row])
        return out

    def is_pinned(self, key: bytes) -> bool:
        row = int(self._settle(self.table.find(words(key)))[0])
        return row >= 0 and bool(self.table.flags[row] & PINNED)

    # ---- time -------------------------------------------------------------------------------

    def expire(self, stepwise: bool = False) -> dict[str, int]:
        """Reclaims what outlived its deadline: daemons, put reservations, leases; frees the
        extents of ended puts whose write tickets lapsed. ``stepwise``: a lost daemon's blocks
        leave the table in the caller's :meth:`drop_step` calls (they are not found meanwhile)."""
        now = self.clock.now()
        out = {"daemons": 0, "puts": 0, "leases": 0}
        for did in [d for d, st in self.daemons.items() if st.deadline < now]:
            self._start_drop(did)
            out["daemons"] += 1
        if not stepwise:
            self._finish_drops()
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

    def __len__(self) -> int:
        """Blocks in the index (committed or being written)."""
        return self.table.live - self._zombies

    def check_integrity(self) -> None:
        """Asserts the accounting: the table, the policy, and per segment its allocator, block,
        pin and lease counts against the rows, copies, quarantined extents and move targets."""
        t = self.table
        t.check_integrity()
        self.policy.check_integrity()
        n = t.n_rows
        live = (t.flags[:n] & LIVE) != 0
        leaving = np.isin(t.seg[:n], list(self._leaving)) & live
        assert self._zombies == int(leaving.sum()), f"rows of lost daemons left {self._zombies} != {leaving.sum()}"
        held = (~live) & (t.leases[:n] > 0)
        quarantined: dict[int, list[tuple[int, int]]] = {}
        for seg, offset, size in self._quarantine.extents(self._current):
            quarantined.setdefault(seg.ref, []).append((offset, size))
        targets: dict[int, list[tuple[int, int]]] = {}
        for seg, offset, size in self._move_extents():
            targets.setdefault(seg.ref, []).append((offset, size))
        c = t.copies
        crow = c.row[: c.used]
        cok = crow >= 0
        for ref, seg in self.segments.items():
            on = t.seg[:n] == ref
            con = cok & (c.seg[: c.used] == ref)  # copies there (their rows are live or leased)
            cro = crow[con]
            if self._current(seg):
                seg.alloc.check_integrity()
                q = quarantined.get(ref, [])
                assert seg.quarantined == sum(size for _, size in q), f"segment {ref}: quarantined {seg.quarantined}"
                used = int(t.size[:n][on & (live | held)].sum(dtype=np.uint64))
                used += int(c.size[: c.used][con].sum(dtype=np.uint64))
                moving = sum(size for _, size in targets.get(ref, []))
                assert seg.alloc.used == used + seg.quarantined + moving, (
                    f"segment {ref}: allocator used {seg.alloc.used} != blocks {used} + quarantined "
                    f"{seg.quarantined} + move targets {moving}"
                )
                mine = np.flatnonzero(on & (live | held))
                seg.alloc.check_disjoint(
                    list(zip(t.off[mine].tolist(), t.size[mine].tolist()))
                    + list(zip(c.off[: c.used][con].tolist(), c.size[: c.used][con].tolist()))
                    + q
                    + targets.get(ref, [])
                )
            copies_live = int(live[cro].sum()) if len(cro) else 0
            assert seg.blocks == int((on & live).sum()) + copies_live, f"segment {ref}: block count {seg.blocks}"
            pinned = (t.flags[:n] & PINNED) != 0
            copies_pinned = int((live[cro] & pinned[cro]).sum()) if len(cro) else 0
            assert seg.pinned == int((on & live & pinned).sum()) + copies_pinned, f"segment {ref}: pinned"
            assert seg.leased == int((on & (t.leases[:n] > 0)).sum()), f"segment {ref}: leased {seg.leased}"
        # A copy is of a committed block, in a lower tier of the same daemon.
        for row in np.unique(crow[cok]).tolist():
            if not t.flags[row] & LIVE:
                continue  # dropped while leased: its copies' extents go when the last lease ends
            assert t.flags[row] & READY, f"row {row} has a copy but is not committed"
            top = self.segments[int(t.seg[row])]
            for i in c.of(row):
                low = self.segments[int(c.seg[i])]
                assert low.daemon is top.daemon and low.spec.tier > top.spec.tier, f"copy {i} of row {row}"
