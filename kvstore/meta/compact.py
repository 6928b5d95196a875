"""The compact index: the block life cycle of :class:`kvstore.meta.index.Index` over a columnar
:class:`kvstore.meta.table.BlockTable`, for indexes of hundreds of millions of blocks.

Same contract and same answers as the object index, with either cache policy (the tests replay
random operation sequences on both): puts in two phases with chain-ordered placement and
eviction, leading-run lookups, leases that pin a run against eviction and free a dropped
block's extent when the last one ends, removal, pinning, touches, expiry, daemon registration
with inventory adoption, daemon loss, and tombstones. Pure state as the object index: no I/O,
time from an injected :class:`Clock`, every method validates first and changes nothing when it
raises.

Where it differs, by design:

- Per block there is a row of fixed-width columns and a hash slot (:mod:`kvstore.meta.table`),
  not an entry, a replica, a location row and four container entries; batch operations
  (lookup, acquire, touch, commit) are vectorised over the batch.
- A block has one replica. A daemon's DRAM above its high watermark demotes its least recently
  used blocks to its SSD and blocks read from SSD are promoted back (:mod:`.compact_tiers`: the
  row moves with the block, and a promoted block keeps no SSD copy). Eviction, admission and
  demotion order are the cache policy's, as on the object index, its state in columns of the
  table (:mod:`.compact_policy`). A put makes no room by eviction in the DRAM of a daemon
  with an SSD (its blocks there have no other copy): it evicts on the SSD instead.
- Locations come back as rows of the table; :meth:`location_rows` packs them as the wire's
  location rows in one call, :meth:`locations` spells them out (as the service does for its
  answers).

The metadata service runs it with ``meta.index=compact`` (:mod:`kvstore.meta.service`): the
service's calls are the object index's, down to two-phase commits with the daemons' answers,
registration in steps, drain, per-tier lookups and the engines' device tier.

As there, a registration naming a generation at or past ``GEN_LIMIT`` is refused whole, the
generation counter never passes ``GEN_MAX`` (:mod:`kvstore.meta.records`), and the extents of a
put that ends uncommitted are held back until its write tickets lapse (:mod:`.quarantine`).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from kvstore.errors import Internal, InvalidArgument
from kvstore.meta.checks import Checks
from kvstore.meta.compact_daemons import CompactMembership
from kvstore.meta.compact_policy import TableAdaptive, TableLru
from kvstore.meta.compact_reads import CompactReads, Lease
from kvstore.meta.compact_tiers import CompactMove, CompactTierMoves
from kvstore.meta.compact_writes import CompactWrites, Put
from kvstore.meta.engines import DeviceTier, EngineTier
from kvstore.meta.quarantine import Quarantine
from kvstore.meta.records import (
    COUNTERS,
    GEN_MAX,
    ROW,
    Clock,
    Daemon,
    IndexLimits,
    Segment,
    Tombstone,
    expired,
)
from kvstore.meta.table import LIVE, PINNED, READY, WRITTEN, BlockTable, words

_ROWS = np.dtype([("ref", "<u4"), ("res", "<u4"), ("off", "<u8"), ("len", "<u8"), ("csum", "<u8"), ("gen", "<u8")])
_NONE = np.empty(0, dtype=np.int64)
TABLE_POLICIES = {"adaptive": TableAdaptive, "lru": TableLru}  # meta.cache_policy (kvstore.meta.compact_policy)


class Location(NamedTuple):
    """A block's replica, spelled out: what the service's answers are made of, as the object
    index's replicas are (:func:`kvstore.wire.locations_to_pb`, the daemons' commits)."""

    segment: Segment
    offset: int
    size: int
    length: int
    checksum: int
    gen: int
    key: bytes

    live = True  # a location is spelled out of a row the index holds at that moment

    @property
    def row(self) -> bytes:
        """The wire's location row (:data:`kvstore.meta.records.ROW`)."""
        return ROW.pack(self.segment.ref, 0, self.offset, self.length, self.checksum, self.gen)


class CompactIndex(Checks, CompactMembership, CompactReads, CompactWrites, CompactTierMoves, DeviceTier):
    """The index's block state in columns. See the module docstring for what it covers."""

    def __init__(self, limits: IndexLimits | None = None, clock: Clock | None = None, rows: int = 1024) -> None:
        self.limits = limits or IndexLimits()
        if self.limits.cache_policy not in TABLE_POLICIES:
            raise InvalidArgument(
                f"unknown cache policy {self.limits.cache_policy!r} (one of {', '.join(TABLE_POLICIES)})"
            )
        self.clock = clock or Clock()
        self.table = BlockTable(rows, counts=self.limits.cache_policy == "adaptive")
        self.policy = TABLE_POLICIES[self.limits.cache_policy](self.table)
        self.engine_tier = EngineTier.for_limits(self.limits)
        self.moves: dict[int, CompactMove] = {}  # tier moves in flight (kvstore.meta.compact_tiers)
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
        self._put_deadlines: list[tuple[float, int]] = []
        self._lease_deadlines: list[tuple[float, int]] = []
        # Extents of puts that ended uncommitted, until their write tickets lapse.
        self._quarantine = Quarantine()

    def _gens_left(self, n: int) -> int:
        """The first of ``n`` fresh generations; raises (having changed nothing) unless they fit
        in 64 bits (see ``Index._gens_left``)."""
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
        return q, *self.table.find_ready(q)

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
        t = self.table
        out = np.zeros(len(rows), dtype=_ROWS)
        out["ref"], out["off"], out["len"] = t.seg[rows], t.off[rows], t.length[rows]
        out["csum"], out["gen"] = t.csum[rows], t.gen[rows]
        return out.tobytes()

    # ---- dropping ---------------------------------------------------------------------------

    def _drop(self, row: int, free: bool = True, hold_until: float | None = None) -> None:
        """A block leaves the index; its extents are freed now or when its last lease ends, or
        (``hold_until``: a put's reservation whose write tickets are still good) at that time
        (``free=False``, its daemon was lost: the space goes with the daemon). Each replica its
        daemon may hold committed leaves a tombstone."""
        t = self.table
        f = int(t.flags[row])
        if not f & LIVE:
            return
        seg = self.segments[int(t.seg[row])]
        self.policy.leaving(row)  # before the table changes (kvstore.meta.policy: defer)
        t.unlink(row)
        t.flags[row] &= 0xFF ^ PINNED
        seg.blocks -= 1
        if f & PINNED:
            seg.pinned -= 1
        if free and f & (READY | WRITTEN):
            self._tombstone_item(
                seg.daemon.spec.daemon_id, Tombstone(seg.spec.segment_id, t.key(row), int(t.off[row]), int(t.gen[row]))
            )
        for i in t.copies.of(row):
            cs = self.segments[int(t.copies.seg[i])]
            cs.blocks -= 1
            if f & PINNED:
                cs.pinned -= 1
            if free:
                self._tombstone_item(
                    cs.daemon.spec.daemon_id,
                    Tombstone(cs.spec.segment_id, t.key(row), int(t.copies.off[i]), int(t.copies.gen[i])),
                )
        if not free:  # their daemon is lost: the copies' space goes with it
            for i in t.copies.of(row):
                t.copies.remove(i)
        if t.leases[row] == 0:
            if free and hold_until is None:
                seg.alloc.release(int(t.off[row]), int(t.size[row]))
            elif free:
                self._quarantine.hold(seg, int(t.off[row]), int(t.size[row]), hold_until)
            self._free_row(row)

    def _free_row(self, row: int) -> None:
        """An unlinked row with no lease left goes back to the table, the extents of its copies
        (tombstoned when it was dropped) to their allocators, where their daemon is still known."""
        t = self.table
        for i in t.copies.of(row):
            seg = self.segments.get(int(t.copies.seg[i]))
            if seg is not None and self._current(seg):
                seg.alloc.release(int(t.copies.off[i]), int(t.copies.size[i]))
            t.copies.remove(i)
        t.free(row)

    # ---- replicas ---------------------------------------------------------------------------

    def _add_copy(self, row: int, seg: Segment, offset: int, size: int, gen: int) -> None:
        """``row``'s block is also committed at ``offset`` of ``seg`` (a lower tier of its daemon)."""
        t = self.table
        t.copies.add(row, seg.ref, offset, size, gen)
        seg.blocks += 1
        if t.flags[row] & PINNED:
            seg.pinned += 1

    def _drop_copy(self, row: int, i: int) -> None:
        """Drops copy ``i`` of an unleased ``row``: tombstoned, its extent freed; the block stays."""
        t = self.table
        seg = self.segments[int(t.copies.seg[i])]
        self._tombstone_item(
            seg.daemon.spec.daemon_id,
            Tombstone(seg.spec.segment_id, t.key(row), int(t.copies.off[i]), int(t.copies.gen[i])),
        )
        seg.alloc.release(int(t.copies.off[i]), int(t.copies.size[i]))
        seg.blocks -= 1
        if t.flags[row] & PINNED:
            seg.pinned -= 1
        t.copies.remove(i)

    def _drop_primary(self, row: int) -> None:
        """Drops the primary replica of an unleased ``row`` that has a copy: the copy becomes its
        primary (what readers get from then on); the block stays, with its recency and count."""
        t = self.table
        i = t.copies.of(row)[0]
        seg = self.segments[int(t.seg[row])]
        self._tombstone_item(
            seg.daemon.spec.daemon_id, Tombstone(seg.spec.segment_id, t.key(row), int(t.off[row]), int(t.gen[row]))
        )
        seg.alloc.release(int(t.off[row]), int(t.size[row]))
        seg.blocks -= 1
        if t.flags[row] & PINNED:
            seg.pinned -= 1
        t.seg[row], t.off[row], t.size[row], t.gen[row] = (
            t.copies.seg[i],
            t.copies.off[i],
            t.copies.size[i],
            t.copies.gen[i],
        )
        t.copies.remove(i)  # (its segment's block and pin counts now count the primary)

    def _evict(self, row: int, seg: Segment) -> None:
        """Makes room in ``seg`` by dropping ``row``'s replica there: the whole block if that is
        its only one, else just that replica (a clean drop: the block is still held)."""
        t = self.table
        if not t.copy[row]:
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += int(t.length[row])
            self._drop(row)
            return
        self.counters["dropped_clean"] += 1
        if int(t.seg[row]) == seg.ref:
            self._drop_primary(row)
        else:
            self._drop_copy(row, t.copies.first_on(row, seg.ref))

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
        row = int(self.table.find(words(key))[0])
        return row >= 0 and bool(self.table.flags[row] & PINNED)

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

    def __len__(self) -> int:
        """Blocks in the index (committed or being written)."""
        return self.table.live

    def check_integrity(self) -> None:
        """Asserts the accounting, as ``Index.check_integrity`` does for the object index."""
        t = self.table
        t.check_integrity()
        self.policy.check_integrity()
        n = t.n_rows
        live = (t.flags[:n] & LIVE) != 0
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
